"""The security settings of keyplane's Kafka clients: validation and the two mappings (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from keyplane.kafka.security import KafkaSecurity, client_config, kafka_security

ENV = "KEYPLANE_KAFKA_"


def test_default_is_plaintext_with_no_credentials() -> None:
    security = KafkaSecurity()
    assert security.client_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert security.spark_options() == {"kafka.security.protocol": "PLAINTEXT"}


def test_sasl_ssl_scram_from_environment_maps_to_kafka_python_and_spark(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    monkeypatch.setenv(ENV + "SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv(ENV + "SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv(ENV + "SASL_USERNAME", "keyplane")
    monkeypatch.setenv(ENV + "SASL_PASSWORD", 's3"cr\\t')
    monkeypatch.setenv(ENV + "SSL_CAFILE", str(ca))
    security = KafkaSecurity()

    assert security.client_kwargs() == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "keyplane",
        "sasl_plain_password": 's3"cr\\t',
        "ssl_cafile": str(ca),
    }
    assert security.spark_options() == {
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule "
        'required username="keyplane" password="s3\\"cr\\\\t";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": str(ca),
    }
    assert 's3"cr' not in repr(security)


def test_plain_mechanism_uses_the_plain_login_module() -> None:
    security = KafkaSecurity(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="u",
        sasl_password="p",
    )
    jaas = security.spark_options()["kafka.sasl.jaas.config"]
    assert jaas == (
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" '
        'password="p";'
    )
    assert "ssl_cafile" not in security.client_kwargs()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u"},
            "KEYPLANE_KAFKA_SASL_PASSWORD",
        ),
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u", "sasl_password": "p"},
            "KEYPLANE_KAFKA_SASL_MECHANISM",
        ),
        ({"security_protocol": "PLAINTEXT", "sasl_username": "u"}, "KEYPLANE_KAFKA_SASL_USERNAME"),
        ({"security_protocol": "SSL", "sasl_mechanism": "PLAIN"}, "KEYPLANE_KAFKA_SASL_MECHANISM"),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "p",
                "ssl_cafile": "ca.pem",
            },
            "KEYPLANE_KAFKA_SSL_CAFILE",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "GSSAPI",
                "sasl_username": "u",
                "sasl_password": "p",
            },
            "sasl_mechanism",
        ),
        ({"security_protocol": "TLS"}, "security_protocol"),
    ],
)
def test_inconsistent_settings_are_refused_naming_the_variable(
    settings: dict[str, str], named: str
) -> None:
    with pytest.raises(ValidationError, match=named):
        KafkaSecurity(**settings)


def test_client_config_adds_the_process_settings_to_the_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV + "SECURITY_PROTOCOL", "SSL")
    kafka_security.cache_clear()
    try:
        assert client_config("kafka:9093") == {
            "bootstrap_servers": "kafka:9093",
            "reconnect_backoff_max_ms": 1_000,
            "security_protocol": "SSL",
        }
    finally:
        kafka_security.cache_clear()
