"""The one error table (sbpstream.protocol.errors)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from sbpstream.protocol import errors as e


def _classes() -> list[type[e.SbpError]]:
    out: list[type[e.SbpError]] = []
    todo = list(e.SbpError.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_every_code_has_exactly_one_class() -> None:
    # NONE is "no error": it has no exception class.
    counts = Counter(cls.code for cls in _classes())
    for code in e.ErrorCode:
        expected = 0 if code is e.ErrorCode.NONE else 1
        assert counts[code] == expected, code
    assert set(e.ERRORS) == set(e.ErrorCode) - {e.ErrorCode.NONE}
    for code, cls in e.ERRORS.items():
        assert cls.code is code
        assert cls.meaning and cls.kind is not e.ErrorKind.NONE


@pytest.mark.parametrize("code", [4, 29, 500, -1, 32767])
def test_unknown_code_maps_to_the_fallback(code: int) -> None:
    err = e.error_for(code, "boom", b"d")
    assert type(err) is e.UnknownServerError
    assert str(code) in err.message and "boom" in err.message
    assert err.detail == b"d"
    assert e.error_class(code) is e.UnknownServerError


def test_known_code_round_trip() -> None:
    for code, cls in e.ERRORS.items():
        err = e.error_for(int(code), "m", b"x")
        assert type(err) is cls
        assert (err.code, err.message, err.detail) == (code, "m", b"x")


def test_codes_sit_in_their_blocks() -> None:
    spec = {0, 1, 2, 3, 5}
    for code in e.ErrorCode:
        assert code in spec or 6 <= code <= 119, code
    client_side = {c for c in e.ErrorCode if c >= 90}
    assert {c.name for c in client_side} >= {"CONNECTION_CLOSED", "CLIENT_TIMEOUT"}


def test_kinds() -> None:
    assert e.kind_of(0) is e.ErrorKind.NONE
    assert e.kind_of(e.ErrorCode.PM_NOT_LEADER) is e.ErrorKind.REDIRECT
    assert e.PmNotLeaderError().redirect
    assert e.RangeSealedError().retriable
    assert not e.CorruptBatchError().retriable


def test_docs_table_lists_every_code() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
    rows = re.findall(r"^\| (\d+) \| ([A-Z_]+) \| ([a-z—]+) \|", doc.read_text(), re.M)
    listed = {int(code): (name, kind) for code, name, kind in rows}
    expected = {int(c): (c.name, e.kind_of(c).value if c else "—") for c in e.ErrorCode}
    assert listed == expected
