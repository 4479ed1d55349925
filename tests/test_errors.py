"""The one error table (sbpstream.protocol.errors)."""

from __future__ import annotations

import gc
import re
from collections import Counter
from pathlib import Path

import pytest

from sbpstream.protocol import errors as e

ALL_CODES = [*e.ErrorCode, *e.ClientErrorCode]


def test_every_code_has_exactly_one_class() -> None:
    # NONE is "no error": it has no exception class.
    counts = Counter(cls.code for cls in e.concrete_errors())
    for code in ALL_CODES:
        expected = 0 if code is e.ErrorCode.NONE else 1
        assert counts[code] == expected, code
    assert set(e.ERRORS) == set(ALL_CODES) - {e.ErrorCode.NONE}
    for code, cls in e.ERRORS.items():
        assert cls.code is code
        assert cls.meaning and cls.kind is not e.ErrorKind.NONE
        assert cls.__name__ in vars(e) and vars(e)[cls.__name__] is cls


def test_the_table_refuses_a_duplicate() -> None:
    class Twin(e.RequestError, e.FatalError):
        code = e.ErrorCode.STREAM_NOT_FOUND

    try:
        with pytest.raises(AssertionError, match="duplicate error class"):
            e.build_table(e.concrete_errors())
    finally:
        del Twin
        gc.collect()  # drop the class from SbpError.__subclasses__()
    assert e.build_table(e.concrete_errors()) == e.ERRORS


def test_each_class_has_one_fault_and_one_retry_group() -> None:
    faults = (e.ClientSideError, e.RequestError, e.ServerFaultError)
    kinds = {
        e.RetriableError: e.ErrorKind.RETRIABLE,
        e.RedirectError: e.ErrorKind.REDIRECT,
        e.FatalError: e.ErrorKind.FATAL,
    }
    for code, cls in e.ERRORS.items():
        assert [issubclass(cls, f) for f in faults].count(True) == 1, cls
        (group,) = [g for g in kinds if issubclass(cls, g)]
        assert cls.kind is kinds[group], cls
        assert issubclass(cls, e.ClientSideError) == isinstance(code, e.ClientErrorCode), cls
        assert issubclass(cls, e.ServerError) == isinstance(code, e.ErrorCode), cls


def test_groups_catch_their_members() -> None:
    with pytest.raises(e.RequestError):
        raise e.StreamNotFoundError("s")
    with pytest.raises(e.RetriableError):
        raise e.RangeSealedError()
    with pytest.raises(e.ServerFaultError):
        raise e.error_for(e.ErrorCode.STORAGE_ERROR)
    with pytest.raises(e.ClientSideError):
        raise e.ClientTimeoutError()
    assert e.TimeoutError_ is e.RequestTimeoutError


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
        assert code in spec or 6 <= code <= 89, code
    for client_code in e.ClientErrorCode:
        assert 90 <= client_code <= 119, client_code
    assert not {int(c) for c in e.ErrorCode} & {int(c) for c in e.ClientErrorCode}


def test_kinds() -> None:
    assert e.kind_of(0) is e.ErrorKind.NONE
    assert e.kind_of(e.ErrorCode.PM_NOT_LEADER) is e.ErrorKind.REDIRECT
    assert e.PmNotLeaderError().redirect
    assert e.RangeSealedError().retriable
    assert not e.CorruptBatchError().retriable
    assert e.kind_of(e.ClientErrorCode.CLIENT_TIMEOUT) is e.ErrorKind.RETRIABLE
    assert e.code_name(91) == "CLIENT_TIMEOUT" and e.code_name(33) == "RANGE_SEALED"
    assert e.code_name(0) == "NONE" and e.code_name(4) == "code 4"


def test_docs_table_lists_every_code() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
    row_re = r"^\| (\d+) \| ([A-Z_]+) \| ([a-z—]+) \| ([a-z—]+) \|\s*`?(\w*)`?\s*\|"
    rows = re.findall(row_re, doc.read_text(), re.M)
    listed = {int(code): tuple(rest) for code, *rest in rows}
    faults = {e.ClientSideError: "client", e.RequestError: "request", e.ServerFaultError: "server"}

    def row(c: int) -> tuple[str, ...]:
        if not c:
            return ("NONE", "—", "—", "")
        cls = e.ERRORS[c]
        fault = next(name for group, name in faults.items() if issubclass(cls, group))
        return (cls.code.name, cls.kind.value, fault, cls.__name__)

    assert listed == {int(c): row(c) for c in ALL_CODES}
