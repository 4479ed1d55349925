"""Golden bytes for every message class, pinned from the encoder before the schema-driven rewrite.

``tests/data/golden_messages.txt`` holds, one case a line, ``label hex``: the exact bytes of the
representative instance of every table class (every field non-default, nested tables, vectors,
unions and error statuses included), of every class at its defaults, and of the APPEND/FETCH
fast-path variants. The wire format is frozen: a changed line is a wire break, never a fixture
to refresh. A new class needs a new line; the failure message prints it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from message_samples import ERR, ERR2, QUOTA_BEFORE_USER, SAMPLES

from sbpstream.protocol import messages as m

GOLDEN_FILE = Path(__file__).parent / "data" / "golden_messages.txt"


def _table_classes() -> list[type[Any]]:
    """Every dataclass the messages module exports: the messages and the tables inside them."""
    classes = [getattr(m, name) for name in m.__all__]
    found = [c for c in classes if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return sorted(found, key=lambda c: c.__name__)


def _first_instances() -> dict[str, Any]:
    """The first instance of each table class met walking the samples (every field non-default)."""
    seen: dict[str, Any] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, tuple):
            for x in obj:
                walk(x)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            seen.setdefault(type(obj).__name__, obj)
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    for sample in [*SAMPLES, m.SystemErrorResponse(ERR)]:
        walk(sample)
    return seen


def _cases() -> dict[str, Any]:
    cases: dict[str, Any] = dict(_first_instances())
    for cls in _table_classes():
        cases[f"{cls.__name__}()"] = cls()
    ok = m.Status()
    mixed = (m.FetchResult(1, 2, 3), m.FetchResult(4, 5, 6, ERR2), m.FetchResult(7, 8, 9, ERR))
    cases.update(
        {
            "AppendResponse/all-ok": m.AppendResponse(
                items=(m.AppendResult(1, 2, 3, 4, ok, 5),) * 3
            ),
            "FetchResponse/all-ok": m.FetchResponse(items=(m.FetchResult(1, 2, 3),) * 3),
            "FetchResponse/mixed": m.FetchResponse(items=mixed * 2),
            # the representative before committed_offsets existed: its bytes are unchanged
            "AppendRequest/one-range": dataclasses.replace(
                next(x for x in SAMPLES if isinstance(x, m.AppendRequest)), committed_offsets=()
            ),
            "AppendRequest/defaults-inside": m.AppendRequest(
                items=(m.AppendItem(), m.AppendItem(range_index=0))
            ),
            "ListRangesResponse/nested-defaults": m.ListRangesResponse(
                items=(m.ListRangesResult(1, ok, (m.Range(replica_nodes=(m.ReplicaNode(),)),)),)
            ),
            "HeartbeatRequest/sdk": m.HeartbeatRequest("sdk", m.ClientRole.CLIENT),
            "Status/detail-only": m.Status(detail=b"\x00"),
            "BufferAckRequest/bytes-only": m.BufferAckRequest(1 << 33),  # as before subscriptions
        }
    )
    # Appended fields (DESCRIBE_RANGES' digest): the bytes from before stay what an instance
    # with the new fields at their defaults encodes to and decodes from.
    err, rng = ERR, _first_instances()["Range"]
    cases.update(
        {
            "DescribeRangeItem/before-digest": m.DescribeRangeItem(42, 4),
            "DescribeRangeResult/before-digest": m.DescribeRangeResult(42, err, rng),
            "DescribeRangesRequest/before-digest": m.DescribeRangesRequest(
                1_000, (m.DescribeRangeItem(42, 4),)
            ),
            "DescribeRangesResponse/before-digest": m.DescribeRangesResponse(
                4, err, (m.DescribeRangeResult(42, err, rng),)
            ),
            # SEAL_RANGES' pm_epoch (the data nodes' fence against a deposed PM leader)
            "SealRangesRequest/before-epoch": m.SealRangesRequest(
                1_000, (m.SealItem(42, 3, 1_500), m.SealItem(43, 0, 0))),
            # FETCH's session_id (fetch sessions): the response from before them
            "FetchResponse/before-sessions": m.FetchResponse(
                20, err, (m.FetchResult(42, 1, 4096, err, 100, 2_000, 1_500),
                          m.FetchResult(43, 7, 0, ERR2, 0, 1, 2))
            ),
        }
    )
    # Quota's user (quotas per principal): every quota message as it was before it
    q0 = QUOTA_BEFORE_USER
    cases.update(
        {
            "Quota/before-user": q0,
            "QuotaResult/before-user": m.QuotaResult(q0, err),
            "SetQuotasRequest/before-user": m.SetQuotasRequest(
                1_000, (q0, m.Quota(0, "", -1, 1 << 30, -1))),
            "SetQuotasResponse/before-user": m.SetQuotasResponse(
                11, err, (m.QuotaResult(q0, err),)),
            "DeleteQuotasRequest/before-user": m.DeleteQuotasRequest(1_000, (q0,)),
            "DeleteQuotasResponse/before-user": m.DeleteQuotasResponse(
                12, err, (m.QuotaResult(q0, ERR2),)),
            "DescribeQuotasResponse/before-user": m.DescribeQuotasResponse(
                13, err, (q0, m.Quota(2, "42", 5, 6, 7))),
            "QuotaCountersResponse/before-user": m.QuotaCountersResponse(
                14, err, (m.QuotaCounter("c/client-1/produce", -7, 4, 2),), 10_000, 3, (q0,)),
        }
    )
    return cases


def _encode(obj: Any) -> bytes:
    return bytes(obj.encode())  # every table encodes as a root table, a header or not


def _decode(cls: type[Any], raw: bytes) -> Any:
    return cls.decode(raw)


def _load() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in GOLDEN_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            label, hex_bytes = line.split(" ")
            assert label not in out, f"duplicate golden label {label}"
            out[label] = hex_bytes
    return out


CASES = _cases()
GOLDEN = _load()


def test_every_table_class_has_a_representative_golden() -> None:
    names = {c.__name__ for c in _table_classes()}
    assert names <= set(CASES), sorted(names - set(CASES))
    assert {f"{n}()" for n in names} <= set(CASES)
    missing = {label: _encode(CASES[label]).hex() for label in sorted(set(CASES) - set(GOLDEN))}
    assert not missing, "add these lines to tests/data/golden_messages.txt:\n" + "\n".join(
        f"{label} {h}" for label, h in missing.items()
    )
    assert set(GOLDEN) == set(CASES), sorted(set(GOLDEN) - set(CASES))


@pytest.mark.parametrize("label", sorted(CASES))
def test_representatives_are_non_default(label: str) -> None:
    obj = CASES[label]
    if "(" in label or "/" in label:
        return  # the defaults and variants are meant to hold defaults
    for f in dataclasses.fields(obj):
        assert getattr(obj, f.name) != f.default, f"{label}.{f.name} is at its default"


@pytest.mark.parametrize("label", sorted(CASES))
def test_golden_bytes(label: str) -> None:
    obj = CASES[label]
    hex_bytes = GOLDEN[label]
    assert _encode(obj).hex() == hex_bytes
    assert _decode(type(obj), bytes.fromhex(hex_bytes)) == obj
