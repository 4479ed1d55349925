"""The sync SDK is derived from the async one: parity and drift checks (no network)."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import pytest
from waiting import eventually

from sbpstream.client import (
    AsyncClient,
    AsyncConsumer,
    AsyncProducer,
    Client,
    Consumer,
    Producer,
    _syncgen,
    pm_addresses,
)
from sbpstream.client.types import codec_of

PAIRS = [(AsyncClient, Client), (AsyncProducer, Producer), (AsyncConsumer, Consumer)]


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS)
def test_every_public_async_method_has_a_sync_twin(async_cls: type, sync_cls: type) -> None:
    for name, member in inspect.getmembers(async_cls):
        if name.startswith("_"):
            continue
        if name in _syncgen.ASYNC_ONLY:  # async by design (the reason is in the table)
            assert not hasattr(sync_cls, name), f"{sync_cls.__name__}.{name} is async-only"
            continue
        assert hasattr(sync_cls, name), f"{sync_cls.__name__} lacks {name}"
        twin = getattr(sync_cls, name)
        if inspect.iscoroutinefunction(member):
            assert not inspect.iscoroutinefunction(twin), f"{sync_cls.__name__}.{name} is async"
            a = list(inspect.signature(member).parameters)
            s = list(inspect.signature(twin).parameters)
            assert a == s, f"{name}: {a} != {s}"


def test_generated_sync_module_is_up_to_date() -> None:
    committed = Path(_syncgen.TARGET).read_text()
    assert committed == _syncgen.render(), (
        "sbpstream/client/sync.py is stale: run python -m sbpstream.client._syncgen"
    )


def test_parity_check_detects_a_missing_twin() -> None:
    class Extra(AsyncClient):
        async def brand_new(self) -> int:
            return 1

    assert not hasattr(Client, "brand_new")
    assert "brand_new" in dict(_syncgen.public_members(Extra))


def test_pm_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SBPSTREAM_PM", raising=False)
    assert pm_addresses(None) == ["127.0.0.1:12378"]
    monkeypatch.setenv("SBPSTREAM_PM", "a:1, b:2")
    assert pm_addresses(None) == ["a:1", "b:2"]
    assert pm_addresses(["x:1,y:2", "z:3"]) == ["x:1", "y:2", "z:3"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        pm_addresses("nonsense")


def test_codec_names() -> None:
    assert codec_of(None) == 0 and codec_of("zstd") == 1 and codec_of("LZ4") == 2
    with pytest.raises(ValueError, match="unknown compression"):
        codec_of("snappy")


def test_sync_client_closes_its_thread() -> None:
    before = set(threading.enumerate())
    c = Client("127.0.0.1:1")
    started = [t for t in threading.enumerate() if t not in before]
    assert len(started) == 1 and started[0].is_alive()  # the client's private loop thread
    c.close()
    eventually(lambda: not started[0].is_alive(), timeout=10, what="the loop thread gone")
    c.close()  # idempotent
    assert set(threading.enumerate()) <= before
