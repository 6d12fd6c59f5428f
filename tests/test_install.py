"""The install is the one we locked: full PySpark 4.3.0, not the thin client."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

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
