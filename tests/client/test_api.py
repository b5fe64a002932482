"""The SDK's public surface: its own frozen types, keyword-only options, one error tree, explicit configuration."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import grpc
import pytest

import sokutatsu.client
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import (
    BrokerError,
    ClientConfig,
    ClientError,
    ConfigError,
    Message,
    OrderedMessage,
    OrderedPublisher,
    Publisher,
    SequencerError,
    Stamp,
    Unreachable,
    errors,
)
from sokutatsu.client._subscription import to_message, to_ordered_message
from sokutatsu.sequencer.v1 import stamp_pb2

WIRE = broker_pb2.Message(
    publisher_id="feed-1",
    publisher_seq=7,
    key="7203.T",
    headers={"venue": "TSE"},
    body=b"2890",
    persistent=True,
    publish_time_unix_nano=1_700_000_000_000_000_000,
    previous_seq=5,
    stamp=stamp_pb2.Stamp(distribution_id=2, domain="a", epoch=3, seq=11, kind=stamp_pb2.STAMP_KIND_DATA, slots=1),
)
FIELDS: dict[str, Any] = {
    "topic": "prices",
    "key": "7203.T",
    "body": b"2890",
    "headers": {"venue": "TSE"},
    "publisher_id": "feed-1",
    "publisher_seq": 7,
    "publish_time_unix_nano": 1_700_000_000_000_000_000,
    "persistent": True,
}


def test_a_received_message_is_the_sdks_own_frozen_type() -> None:
    message = to_message(WIRE, "prices")
    assert type(message) is Message
    assert message == Message(**FIELDS)
    assert {f.name for f in dataclasses.fields(Message)} == set(FIELDS), "no previous_seq, no stamp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.key = "other"  # type: ignore[misc]
    assert to_message(broker_pb2.Message(key="k"), "t").headers == {}


def test_an_ordered_message_carries_the_public_stamp() -> None:
    message = to_ordered_message(WIRE, "ordered")
    assert message == OrderedMessage(
        **{**FIELDS, "topic": "ordered"}, stamp=Stamp(domain="a", seq=11, distribution_id=2, epoch=3)
    )
    assert {f.name for f in dataclasses.fields(Stamp)} == {"domain", "seq", "distribution_id", "epoch"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.stamp = Stamp(domain="b", seq=1, distribution_id=1, epoch=1)  # type: ignore[misc]


def test_options_are_keyword_only_and_publish_takes_no_stamp() -> None:
    for method in (Publisher.publish, Publisher.publish_nowait):
        parameters = inspect.signature(method).parameters
        assert list(parameters)[:4] == ["self", "topic", "key", "body"]
        assert "stamp" not in parameters
        for name in ("headers", "persistent"):
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, (method, name)
    for ordered in (OrderedPublisher.publish, OrderedPublisher.publish_nowait):
        assert inspect.signature(ordered).parameters["headers"].kind is inspect.Parameter.KEYWORD_ONLY


def test_every_error_is_a_client_error_in_one_module_and_says_if_it_is_retryable() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert {c.__name__ for c in classes} >= {"SequencerError", "OrderingError", "Unreachable", "ConfigError"}
    for cls in classes:
        assert issubclass(cls, ClientError), cls
        assert cls.__module__ == "sokutatsu.client.errors"
        assert cls.__name__ in sokutatsu.client.__all__
    assert not issubclass(Unreachable, ConnectionError), "start() raises the SDK's error, not the builtin"
    assert Unreachable("no broker").retryable
    assert BrokerError(grpc.StatusCode.UNAVAILABLE, "stopping").retryable
    assert not BrokerError(grpc.StatusCode.INVALID_ARGUMENT, "body too large").retryable
    assert SequencerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy").retryable
    assert not errors.GapError("p", 1, 2).retryable


def test_configuration_reads_the_environment_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOKUTATSU_AUTH_TOKEN", "from-env")
    monkeypatch.setenv("SOKUTATSU_TLS_CA", str(tmp_path / "missing.pem"))
    assert ClientConfig() == ClientConfig(tls=None, token=None)
    assert Publisher("127.0.0.1:1").config == ClientConfig()
    with pytest.raises(ConfigError, match=r"^SOKUTATSU_TLS_CA='.*missing.pem': cannot read it"):
        ClientConfig.from_env()
    token = "t"  # noqa: S105 - a test value
    assert ClientConfig.from_env({"SOKUTATSU_AUTH_TOKEN": token, "SOKUTATSU_TLS_CA": ""}) == ClientConfig(token=token)
    with pytest.raises(ConfigError, match=r"^SOKUTATSU_TLS_CERT is set but SOKUTATSU_TLS_KEY is not"):
        ClientConfig.from_env({"SOKUTATSU_TLS_CERT": str(tmp_path / "c.pem")})
