"""Producer and consumer options: one dataclass each, the defaults stated once. The async and
sync factories build equal options from the same keyword arguments; docs/client.md's option
tables are the ones rendered from the dataclasses."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sbpstream.client import AsyncClient, Client
from sbpstream.client.options import ConsumerOptions, ProducerOptions, options_table
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import InvalidRequestError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "client.md"


def test_factories_restate_no_default() -> None:
    """The factories take the options as keywords and state none of their defaults."""
    for fn in (AsyncClient.producer, AsyncClient.consumer, Client.producer, Client.consumer):
        params = inspect.signature(fn).parameters
        fields = {f.name for f in (*dataclasses.fields(ProducerOptions),
                                   *dataclasses.fields(ConsumerOptions))}
        restated = sorted(set(params) & fields - {"start"})
        assert restated == [], f"{fn.__qualname__} restates {restated}"
        assert any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_every_field_is_documented() -> None:
    for cls in (ProducerOptions, ConsumerOptions):
        table = options_table(cls)
        for f in dataclasses.fields(cls):
            row = next(r for r in table.splitlines() if r.startswith(f"| `{f.name}` |"))
            assert len(row.split("|")[3].strip()) > 10, row


def test_docs_hold_the_rendered_tables() -> None:
    text = DOCS.read_text()
    for cls in (ProducerOptions, ConsumerOptions):
        assert options_table(cls) in text, f"docs/client.md: {cls.__name__} table is stale"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster"), datanodes=1) as c:
        yield c


def test_async_and_sync_factories_build_equal_options(cluster: LocalCluster) -> None:
    kw_p: dict[str, Any] = dict(linger_ms=1.5, compression="zstd", max_in_flight_per_stream=2)
    kw_c: dict[str, Any] = dict(end=7, max_wait_ms=50, subscribe=False, auto_reset="earliest")

    async def async_side() -> tuple[int, ProducerOptions, ConsumerOptions]:
        async with AsyncClient(cluster.pm_address) as ac:
            sid = await ac.create_stream()
            ap = ac.producer(**kw_p)
            acons = ac.consumer(sid, 3, **kw_c)
            await ap.close()
            await acons.close()
            return sid, ap.options, acons.options

    sid, ap_options, ac_options = asyncio.run(async_side())
    with Client(cluster.pm_address) as sc:
        with sc.producer(**kw_p) as sp:
            assert sp._async.options == ap_options == ProducerOptions(**kw_p)
        scons = sc.consumer(sid, 3, **kw_c)
        assert scons._async.options == ac_options == ConsumerOptions(start=3, **kw_c)
        scons.close()
        # the defaults: one place
        with sc.producer() as sp:
            assert sp._async.options == ProducerOptions()
        assert sc.consumer(sid)._async.options == ConsumerOptions()
        # an options object, a keyword overriding one field
        base = ConsumerOptions(max_wait_ms=10, subscribe=False)
        got = sc.consumer(sid, options=base, max_wait_ms=20)._async.options
        assert got == dataclasses.replace(base, max_wait_ms=20)


def test_an_unknown_option_is_one_line_naming_the_valid_ones() -> None:
    from sbpstream.client.options import build

    with pytest.raises(InvalidRequestError, match=r"unknown ProducerOptions field\(s\) "
                                                  r"lingr_ms: valid are .*linger_ms"):
        build(ProducerOptions, None, {"lingr_ms": 1})
    with pytest.raises(InvalidRequestError, match=re.escape("max_in_flight_per_stream must be")):
        ProducerOptions(max_in_flight_per_stream=9)
