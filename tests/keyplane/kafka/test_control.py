"""The control topic (keyplane.kafka.control) against the real embedded broker.

The job's driver reads exact offset ranges of this topic at every batch
boundary (paper 000 §3.4), so these tests check that a read returns exactly
the records of its range, in order and authenticated, and that a forged
record is reported without stopping the genuine ones after it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from kafka import KafkaProducer

import keyplane.kafka.producer
from keyplane.control.messages import ControlMessage, decode, encode
from keyplane.control.signing import KEY_ENV_VAR, MissingKeyError, canonical_json, sign
from keyplane.kafka import admin, control
from keyplane.kafka.admin import TopicError, ensure_topic
from keyplane.kafka.control import ControlChannel

KEY = b"control-channel-tests-0123456789abcdef"


def command(kind: str, version: int, operator: str | None = None) -> ControlMessage:
    return ControlMessage(
        type=kind,
        config_version=version,
        previous_version=version - 1,
        operator=operator,
        checksum=f"checksum-of-v{version}",
        sender="controller",
    )


def unsigned(message: ControlMessage) -> ControlMessage:
    return message.model_copy(update={"signature": None})


def produce_raw(broker: str, topic: str, values: list[bytes]) -> None:
    """Write records the way anyone with access to the topic could: no signing key."""
    producer = KafkaProducer(bootstrap_servers=broker, acks="all")
    try:
        for value in values:
            producer.send(topic, value=value, partition=0)
        producer.flush()
    finally:
        producer.close()


@pytest.mark.integration
def test_signed_messages_round_trip_in_order_and_reads_are_exact(
    broker: str, topic_name: str
) -> None:
    sent = [command("PREPARE", 2), command("PROPAGATE", 2, "A"), command("PROPAGATE", 2, "B")]
    with ControlChannel(broker, topic_name, key=KEY) as channel:
        channel.ensure()
        assert channel.end_offset() == 0
        assert channel.read(0).messages == ()

        channel.send(sent)
        everything = channel.read(0)
        middle = channel.read(1, 2)
        channel.send([command("DONE", 2)])
        since_last = channel.read(everything.end)

    assert everything.end == 3 and everything.rejected == ()
    assert [offset for offset, _ in everything.messages] == [0, 1, 2]
    assert [unsigned(message) for _, message in everything.messages] == sent
    assert all(len(message.signature or "") == 64 for _, message in everything.messages)
    assert [(offset, message.describe()) for offset, message in middle.messages] == [
        (1, "PROPAGATE A v2")
    ]
    assert middle.end == 2
    assert [(offset, message.describe()) for offset, message in since_last.messages] == [
        (3, "DONE v2")
    ]
    assert since_last.end == 4


@pytest.mark.integration
def test_the_end_is_asked_over_one_consumer_that_sees_every_new_record(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's driver asks for the end at every batch boundary; a consumer opened for
    each ask costs a connection and a metadata round trip every time."""
    opened: list[object] = []

    class CountedConsumer(admin.KafkaConsumer):
        def __init__(self, **config: Any) -> None:
            super().__init__(**config)
            opened.append(self)

    with ControlChannel(broker, topic_name, key=KEY) as channel:
        channel.ensure()
        monkeypatch.setattr(admin, "KafkaConsumer", CountedConsumer)
        ends = [channel.end_offset()]
        for version in range(2, 6):
            channel.send([command("PREPARE", version)])
            ends.append(channel.end_offset())

    assert ends == [0, 1, 2, 3, 4]
    assert len(opened) == 1


@pytest.mark.integration
def test_forged_records_are_reported_not_raised_and_later_messages_still_arrive(
    broker: str, topic_name: str
) -> None:
    genuine = command("PREPARE", 2)
    with ControlChannel(broker, topic_name, key=KEY) as channel:
        channel.ensure()
        body = genuine.model_dump(mode="json", exclude={"signature"})
        produce_raw(
            broker,
            topic_name,
            [
                json.dumps(body).encode(),
                encode(command("ABORT", 2), b"a-key-the-attacker-made-up-1234567"),
                b"{not json",
            ],
        )
        channel.send([genuine])
        read = channel.read(0)

    assert [(offset, why.reason) for offset, why in read.rejected] == [
        (0, "missing_signature"),
        (1, "bad_signature"),
        (2, "not_json"),
    ]
    assert [(offset, unsigned(message)) for offset, message in read.messages] == [(3, genuine)]
    assert read.end == 4


@pytest.mark.integration
def test_records_that_used_to_crash_decode_are_rejected_and_later_messages_still_arrive(
    broker: str, topic_name: str
) -> None:
    """Unsigned deep nesting, and a signed list as the type: each raised past decode,
    out of read and out of the job's latestOffset, at every restart (000 §3.4)."""
    genuine = command("PREPARE", 2)
    body = {**genuine.model_dump(mode="json", exclude={"signature"}), "type": []}
    with ControlChannel(broker, topic_name, key=KEY) as channel:
        channel.ensure()
        produce_raw(
            broker,
            topic_name,
            [b"[" * 100_000, canonical_json({**body, "signature": sign(body, KEY)})],
        )
        channel.send([genuine])
        read = channel.read(0)

    assert [(offset, why.reason) for offset, why in read.rejected] == [
        (0, "not_json"),
        (1, "schema"),
    ]
    assert [(offset, unsigned(message)) for offset, message in read.messages] == [(2, genuine)]
    assert read.end == 3


@pytest.mark.integration
def test_anything_else_decode_raises_is_a_rejected_record_logged_with_its_offset(
    broker: str, topic_name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The backstop for a bug in decode: the record is refused, never raised."""
    poison = b"a record decode has a bug on"

    def buggy_decode(raw: bytes, key: bytes | str | None = None) -> ControlMessage:
        if raw == poison:
            raise TypeError("unhashable type: 'list'")
        return decode(raw, key)

    monkeypatch.setattr(control, "decode", buggy_decode)
    genuine = command("PREPARE", 2)
    with ControlChannel(broker, topic_name, key=KEY) as channel:
        channel.ensure()
        produce_raw(broker, topic_name, [poison])
        channel.send([genuine])
        with caplog.at_level(logging.WARNING, logger=control.__name__):
            read = channel.read(0)

    [(offset, why)] = read.rejected
    assert (offset, why.reason) == (0, "undecodable")
    assert "TypeError: unhashable type: 'list'" in why.detail
    assert [(offset, unsigned(message)) for offset, message in read.messages] == [(1, genuine)]
    assert read.end == 2
    [logged] = [r for r in caplog.records if r.name == control.__name__]
    assert f"{topic_name}, offset 0" in logged.getMessage() and logged.exc_info is not None


@pytest.mark.integration
def test_a_topic_with_several_partitions_is_refused(broker: str, topic_name: str) -> None:
    ensure_topic(broker, topic_name, 3)
    with (
        ControlChannel(broker, topic_name, key=KEY) as channel,
        pytest.raises(TopicError, match=r"has 3 partitions.*exactly one"),
    ):
        channel.ensure()


@pytest.mark.integration
def test_reading_past_the_end_times_out_naming_the_topic_and_offsets(
    broker: str, topic_name: str
) -> None:
    with ControlChannel(broker, topic_name, key=KEY, read_timeout_s=1.0) as channel:
        channel.ensure()
        channel.send([command("PREPARE", 2)])
        with pytest.raises(TopicError) as caught:
            channel.read(0, 3)
    assert topic_name in str(caught.value)
    assert "no record past offset 1 (reading offsets 0..2) after 1 s" in str(caught.value)


def test_a_channel_without_a_key_fails_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV_VAR, raising=False)
    with pytest.raises(MissingKeyError, match=KEY_ENV_VAR):
        ControlChannel("127.0.0.1:1", "control")
    monkeypatch.setenv(KEY_ENV_VAR, "from-the-environment")
    assert ControlChannel("127.0.0.1:1", "control").topic == "control"


def test_a_send_the_broker_refuses_with_fake_producers_goes_out_again_through_a_new_producer(
    fake_producers: Any,
) -> None:
    """After a broker restart the broker may refuse the kept producer (an unknown producer id,
    a sequence out of order); the messages then go out once more, in order, through a new one."""
    made = fake_producers(keyplane.kafka.producer, 1, None)
    channel = ControlChannel("broker:9092", "job.control", key=KEY)
    messages = [command("PREPARE", 2), command("PROPAGATE", 2, "A")]
    channel.send(messages)
    refused, replacement = made
    assert refused.closed
    assert [unsigned(decode(value, KEY)) for _, value in replacement.sent] == messages
    assert replacement.partitions == [control.PARTITION, control.PARTITION]
    channel.send([command("PROPAGATE", 2, "B")])
    assert len(made) == 2, "the replacement is kept for the next message"
    channel.close()
    assert replacement.closed


def test_a_send_two_fake_producers_cannot_deliver_names_every_message_and_the_topic(
    fake_producers: Any,
) -> None:
    made = fake_producers(keyplane.kafka.producer, 0, 0)
    channel = ControlChannel("broker:9092", "job.control", key=KEY)
    with pytest.raises(TopicError) as raised:
        channel.send([command("PREPARE", 2), command("PROPAGATE", 2, "A")])
    assert "'job.control'" in str(raised.value)
    assert "PREPARE v2" in str(raised.value) and "PROPAGATE A v2" in str(raised.value)
    assert len(made) == 2 and all(producer.closed for producer in made)
