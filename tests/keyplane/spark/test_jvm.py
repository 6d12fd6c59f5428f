"""The JVM stages' jar: built from the shipped source, found, or refused in one line."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from keyplane.aggregates import RunningCount, ValueCounts
from keyplane.spark import jvm
from keyplane.spark.routed_counts import StageEngineError, resolve_engine


def test_the_jar_builds_from_the_shipped_source(tmp_path: Path) -> None:
    jar = jvm.build_jar(tmp_path / "stages.jar")
    with zipfile.ZipFile(jar) as built:
        names = set(built.namelist())
    assert "keyplane/spark/jvm/RoutedStages.class" in names
    assert {
        "keyplane/spark/jvm/RoutedStages$StageA.class",
        "keyplane/spark/jvm/RoutedStages$StageB.class",
    } <= names
    assert not list(tmp_path.glob("*.partial")), "the jar is moved into place whole"


def test_a_named_jar_that_does_not_exist_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(jvm.JAR_ENV, str(tmp_path / "missing.jar"))
    jvm.stages_jar.cache_clear()
    try:
        with pytest.raises(jvm.JvmStagesUnavailable, match=r"KEYPLANE_JVM_JAR=.*no such file"):
            jvm.stages_jar()
        assert jvm.available_jar() is None
    finally:
        jvm.stages_jar.cache_clear()


def test_without_javac_the_build_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(jvm.JvmStagesUnavailable, match="need a JDK once"):
        jvm.build_jar(tmp_path / "stages.jar")


def test_the_session_of_the_tests_has_the_jvm_stages(spark) -> None:
    assert jvm.loaded(spark)


def test_engine_choice_pure() -> None:
    """The running count runs in the JVM where the jar is loaded; any other aggregate, or
    no jar, runs in Python under ``auto`` and is refused under ``jvm``."""
    count, other = RunningCount(), ValueCounts()
    assert resolve_engine("auto", None, None, jvm_loaded=True) == "jvm"
    assert resolve_engine("auto", count, count, jvm_loaded=True) == "jvm"
    assert resolve_engine("auto", count, other, jvm_loaded=True) == "python"
    assert resolve_engine("auto", None, None, jvm_loaded=False) == "python"
    assert resolve_engine("python", None, None, jvm_loaded=True) == "python"
    assert resolve_engine("jvm", None, None, jvm_loaded=True) == "jvm"
    with pytest.raises(StageEngineError, match="only the running count"):
        resolve_engine("jvm", other, None, jvm_loaded=True)
    with pytest.raises(StageEngineError, match="no keyplane JVM stages"):
        resolve_engine("jvm", None, None, jvm_loaded=False)
