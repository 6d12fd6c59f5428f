"""Spark's own Kafka connector (``spark-sql-kafka-0-10``): where its jars are, and how a
session gets them.

PySpark's wheel ships no connector, and a session that asks for it by
``spark.jars.packages`` resolves it from a repository at every start. So
``scripts/install-jars`` (run by ``make bootstrap``) copies the connector
that ``deploy/spark-kafka/pom.xml`` pins, with the dependencies PySpark lacks
(the Kafka client, commons-pool2, the token provider), into
``.tools/spark-kafka-<version>/libs`` once, from Maven Central, and
:func:`connector_jars` names them for ``spark.jars``.

The pinned connector is the nearest version to the installed Spark that
Maven Central serves; ``tests/keyplane/spark/test_connector.py`` proves that
a session of the installed Spark reads a real Apache Kafka topic through it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CONNECTOR_VERSION = "4.2.0"
"""The connector that ``deploy/spark-kafka/pom.xml`` pins (its ``spark-kafka.version``)."""
CONNECTOR_HOME_ENV = "KEYPLANE_SPARK_KAFKA_HOME"


class ConnectorUnavailable(RuntimeError):
    """The connector's jars are not installed; the message says how to install them."""


def connector_dir() -> Path:
    """The installation: ``KEYPLANE_SPARK_KAFKA_HOME``, else the checkout's ``.tools`` one."""
    given = os.environ.get(CONNECTOR_HOME_ENV)
    if given:
        return Path(given)
    return Path(__file__).resolve().parents[3] / ".tools" / f"spark-kafka-{CONNECTOR_VERSION}"


def connector_jars() -> list[Path]:
    """Every jar of the installed connector, for a session's ``spark.jars``.

    ``scripts/install-jars`` moves the folder into place only once its jars
    were checked, so a half-copied set is never found here.
    """
    folder = connector_dir()
    jars = sorted((folder / "libs").glob("*.jar"))
    if not any(jar.name.startswith("spark-sql-kafka-0-10_") for jar in jars):
        raise ConnectorUnavailable(
            f"Spark's Kafka connector is not installed in {folder}: run scripts/install-jars "
            f"(make bootstrap does), or set {CONNECTOR_HOME_ENV} to a folder with its jars "
            "in libs/"
        )
    return jars


def installed_connector_jars() -> list[Path]:
    """:func:`connector_jars` if the connector is installed, else none."""
    try:
        return connector_jars()
    except ConnectorUnavailable:
        return []


def connector_jars_setting() -> str:
    """:func:`connector_jars` as the comma-separated value of ``spark.jars``."""
    return ",".join(str(jar) for jar in connector_jars())


PROVIDER_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
"""The connector's entry point: a session that can load it can read ``format("kafka")``."""


def check_loaded(spark: SparkSession) -> None:
    """Raise :class:`ConnectorUnavailable`, in one line, unless ``spark`` has the connector."""
    from keyplane.spark.jvm import class_loaded

    if not class_loaded(spark, PROVIDER_CLASS):
        raise ConnectorUnavailable(
            "this Spark session has no Kafka connector on its classpath: run scripts/install-jars "
            "(make bootstrap does) so that keyplane's sessions load it, pass its jars in "
            "spark.jars, or read the events through keyplane's own source (--source python)"
        )
