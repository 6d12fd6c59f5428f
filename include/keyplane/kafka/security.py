"""How keyplane's Kafka clients authenticate: one settings object, two mappings.

A production cluster (Apache Kafka with SASL over TLS) refuses anonymous
clients, and every client keyplane opens — producers, consumers and admin
clients on the driver, the Python source's readers on the executors, Spark's
own JVM connector when ``KEYPLANE_KAFKA_SOURCE=jvm`` — must present the same
credentials. They are read here, once per process, from ``KEYPLANE_KAFKA_*``
variables only: a password never travels in a command line, a data source
option or a Spark checkpoint, and the repository holds none. Executors get
the variables from their environment (``spark.executorEnv.*`` or the
cluster's secret store, docs/deploy.md).

:meth:`KafkaSecurity.client_kwargs` maps the settings to kafka-python's
keyword arguments and :meth:`KafkaSecurity.spark_options` to the JVM
connector's ``kafka.``-prefixed options; nothing else in keyplane names a
security setting. The embedded broker (tansu) speaks PLAINTEXT only, so the
default is PLAINTEXT; the SASL/PLAIN handshake of kafka-python's clients is
tested against Apache Kafka (:class:`~keyplane.kafka.apache_kafka.SaslPlainListener`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

_LOGIN_MODULES: dict[SaslMechanism, str] = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


class KafkaSecurity(BaseSettings):
    """Transport security and SASL credentials of every keyplane Kafka client.

    ``SASL_*`` protocols need a mechanism, a username and a password;
    ``PLAINTEXT`` and ``SSL`` take none of them, so a credential set by
    mistake is reported instead of silently ignored. ``ssl_cafile`` (a PEM
    bundle) applies to the TLS protocols only; unset, the system's trust
    store verifies the brokers.
    """

    model_config = SettingsConfigDict(env_prefix="KEYPLANE_KAFKA_", frozen=True, extra="ignore")

    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = Field(
        default=None, description="Read from KEYPLANE_KAFKA_SASL_PASSWORD; never logged."
    )
    ssl_cafile: Path | None = Field(
        default=None, description="PEM file of the CA that signed the brokers' certificates."
    )

    @model_validator(mode="after")
    def _check_consistent(self) -> KafkaSecurity:
        sasl = self.security_protocol.startswith("SASL_")
        credentials = {
            "KEYPLANE_KAFKA_SASL_MECHANISM": self.sasl_mechanism,
            "KEYPLANE_KAFKA_SASL_USERNAME": self.sasl_username,
            "KEYPLANE_KAFKA_SASL_PASSWORD": self.sasl_password,
        }
        if sasl:
            missing = [name for name, value in credentials.items() if not value]
            if missing:
                raise ValueError(
                    f"security protocol {self.security_protocol} needs {', '.join(missing)}"
                )
        else:
            extra = [name for name, value in credentials.items() if value]
            if extra:
                raise ValueError(
                    f"{', '.join(extra)} set, but security protocol {self.security_protocol} "
                    "does not authenticate with SASL; set KEYPLANE_KAFKA_SECURITY_PROTOCOL "
                    "to SASL_SSL (or SASL_PLAINTEXT)"
                )
        if self.ssl_cafile is not None and not self.uses_tls:
            raise ValueError(
                f"KEYPLANE_KAFKA_SSL_CAFILE set, but security protocol "
                f"{self.security_protocol} does not use TLS"
            )
        return self

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python's producer, consumer and admin client."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.sasl_mechanism is not None:
            assert self.sasl_password is not None
            kwargs |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password.get_secret_value(),
            }
        if self.ssl_cafile is not None:
            kwargs["ssl_cafile"] = str(self.ssl_cafile)
        return kwargs

    def spark_options(self) -> dict[str, str]:
        """Options for Spark's Kafka connector: Kafka client properties prefixed ``kafka.``.

        The JVM client takes credentials as a JAAS line, and a PEM CA file
        as a truststore of type PEM (Kafka 2.7+, KIP-651).
        """
        options: dict[str, str] = {"kafka.security.protocol": self.security_protocol}
        if self.sasl_mechanism is not None:
            assert self.sasl_username is not None and self.sasl_password is not None
            options["kafka.sasl.mechanism"] = self.sasl_mechanism
            options["kafka.sasl.jaas.config"] = (
                f"{_LOGIN_MODULES[self.sasl_mechanism]} required "
                f"username={_jaas_quoted(self.sasl_username)} "
                f"password={_jaas_quoted(self.sasl_password.get_secret_value())};"
            )
        if self.ssl_cafile is not None:
            options["kafka.ssl.truststore.type"] = "PEM"
            options["kafka.ssl.truststore.location"] = str(self.ssl_cafile)
        return options


def _jaas_quoted(value: str) -> str:
    """A JAAS option value in double quotes, with backslashes and quotes escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


@functools.cache
def kafka_security() -> KafkaSecurity:
    """This process's settings, read from the environment on first use."""
    return KafkaSecurity()


RECONNECT_BACKOFF_MAX_MS = 1_000
"""The longest wait between two connection attempts to a broker that is down.

kafka-python doubles the wait up to 30 s, where Apache Kafka's Java client
stops at 1 s. A broker that restarts (a JVM takes seconds to start) is then
found again at once rather than up to 30 s later, by which time a client's
30 s bootstrap timeout may have failed the job's micro-batch."""


def client_config(bootstrap_servers: str) -> dict[str, Any]:
    """``bootstrap_servers`` plus the security keyword arguments, for any kafka-python client,
    and the reconnection back-off of :data:`RECONNECT_BACKOFF_MAX_MS`."""
    return {
        "bootstrap_servers": bootstrap_servers,
        "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        **kafka_security().client_kwargs(),
    }
