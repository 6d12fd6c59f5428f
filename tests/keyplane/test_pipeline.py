"""The pipeline declaration refuses what cannot run, in one line that names the stage."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from keyplane import (
    KafkaSource,
    ParquetSink,
    Pipeline,
    PipelineError,
    RunningCount,
    Stage,
    load_pipeline,
)
from keyplane.pipeline import fingerprint_changes

SOURCE = KafkaSource("clicks", "user_id STRING, page STRUCT<category: STRING>")


def pipeline(*stages: Stage) -> Pipeline:
    return Pipeline("clicks", SOURCE, stages, ParquetSink("out"))


def test_a_chain_keeps_its_stages_upstream_first() -> None:
    p = pipeline(Stage("users", "user_id"), Stage("pages", "page.category", value="user_id"))
    assert p.stage_names == ("users", "pages")
    assert p.stage("pages").value == "user_id"
    assert SOURCE.topics == ("clicks",)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: pipeline(), "it has no stage"),
        (lambda: pipeline(Stage("a", "x"), Stage("a", "y")), "'a' is used twice"),
        (lambda: Stage("two words", "x"), "stage 'two words': a name is a letter"),
        (lambda: Stage("users", " "), "stage 'users': the key expression is empty"),
        (lambda: Stage("users", "x", aggregate=object()), "missing zero, add, merge"),
        (lambda: KafkaSource((), "x INT"), "topics must be non-empty"),
        (lambda: KafkaSource("t", "x INT", format="avro"), "format 'avro'"),
        (lambda: Pipeline("p", SOURCE, (Stage("a", "x"),), "out"), "the sink must be"),
    ],
)
def test_a_declaration_that_cannot_run_fails_in_one_line(build, message) -> None:
    with pytest.raises(PipelineError, match=message) as error:
        build()
    assert "\n" not in str(error.value)


def test_an_aggregate_whose_zero_does_not_round_trip_is_refused() -> None:
    class Broken(RunningCount):
        def decode(self, text: str) -> int:
            raise ValueError("no")

    with pytest.raises(PipelineError, match="stage 'users': the aggregate's zero"):
        Stage("users", "user_id", aggregate=Broken())


def test_fingerprint_changes_name_what_the_checkpoint_cannot_take() -> None:
    old = pipeline(Stage("users", "user_id"), Stage("pages", "page.category")).fingerprint()
    same = pipeline(Stage("users", "user_id"), Stage("pages", "page.category")).fingerprint()
    assert fingerprint_changes(old, same) == []
    new = pipeline(Stage("users", "lower(user_id)"), Stage("carts", "cart")).fingerprint()
    assert sorted(fingerprint_changes(old, new)) == [
        "stage 'carts' was added",
        "stage 'pages' was removed",
        "stage 'users': key 'user_id' became 'lower(user_id)'",
    ]


def test_load_pipeline_takes_an_attribute_or_a_factory(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mypipes.py").write_text(
        textwrap.dedent(
            """
            from keyplane import KafkaSource, ParquetSink, Pipeline, Stage
            clicks = Pipeline("clicks", KafkaSource("t", "u STRING"), (Stage("u", "u"),),
                              ParquetSink("o"))
            def build():
                return clicks
            broken = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mypipes", None)
    assert load_pipeline("mypipes:clicks").stage_names == ("u",)
    assert load_pipeline("mypipes:build") is load_pipeline("mypipes:clicks")
    for spec, message in [
        ("mypipes", "expected 'module:attribute'"),
        ("nosuchmodule:x", "cannot import 'nosuchmodule'"),
        ("mypipes:nothing", "has no 'nothing'"),
        ("mypipes:broken", "is a int, not a keyplane Pipeline"),
    ]:
        with pytest.raises(PipelineError, match=message):
            load_pipeline(spec)
