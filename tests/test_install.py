"""The install is the one we locked (full PySpark 4.3.0, not the client), set up by bootstrap."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
import zipimport
from pathlib import Path
from types import ModuleType

import pyspark


def test_pyspark_is_the_full_distribution_at_the_locked_version() -> None:
    assert pyspark.__version__ == "4.3.0"
    jars = Path(pyspark.__file__).parent / "jars"
    assert any(j.name.startswith("spark-sql_") for j in jars.glob("*.jar")), "pyspark jars missing"


def test_pyspark_client_is_not_installed_over_pyspark() -> None:
    names = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    assert "pyspark-client" not in names
    assert importlib.metadata.version("pyspark") == "4.3.0"


def test_pinned_stack_versions() -> None:
    assert importlib.metadata.version("apache-airflow").startswith("3.3.")
    assert importlib.metadata.version("great-expectations").startswith("1.")
    assert importlib.metadata.version("kafka-python") == "3.0.12"
    assert int(importlib.metadata.version("pandas").split(".")[0]) < 3


def _compile_pyspark_zip() -> ModuleType:
    """``scripts/compile_pyspark_zip.py``, loaded as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "compile_pyspark_zip.py"
    spec = importlib.util.spec_from_file_location("compile_pyspark_zip", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spark_python_workers_import_pyspark_from_bytecode() -> None:
    """Bootstrap compiled the zip Spark puts first on its workers' path, and Python uses it."""
    archive = _compile_pyspark_zip().worker_zip()
    py4j = next(archive.parent.glob("py4j-*-src.zip"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(archive), str(py4j)])}
    loaded = subprocess.run(
        [sys.executable, "-c", "import pyspark.worker; print(pyspark.worker.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert loaded == f"{archive}{os.sep}pyspark{os.sep}worker.pyc"


def _load(archive: Path, name: str) -> ModuleType:
    spec = zipimport.zipimporter(str(archive)).find_spec(name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiled_zip_runs_its_bytecode_and_never_a_stale_one(tmp_path: Path) -> None:
    script = _compile_pyspark_zip()
    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("mod.py", "VALUE = 1\n")
        zf.writestr("broken.py", "def (:\n")
    assert not script.is_compiled(archive)
    assert script.compile_zip(archive) == 1
    with zipfile.ZipFile(archive) as zf:
        assert sorted(zf.namelist()) == ["broken.py", "mod.py", "mod.pyc"]
        stale_pyc = zf.read("mod.pyc")
    module = _load(archive, "mod")
    assert module.__file__ is not None
    assert (module.VALUE, Path(module.__file__).name) == (1, "mod.pyc")

    changed = tmp_path / "changed.zip"
    with zipfile.ZipFile(changed, "w") as zf:
        zf.writestr("mod.py", "VALUE = 2\n")
        zf.writestr("mod.pyc", stale_pyc)
    assert _load(changed, "mod").VALUE == 2
