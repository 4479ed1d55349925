"""The committed generated code (tests/sbp_fbs) is exactly what flatc makes of sbp.fbs."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbpstream.protocol import flatc


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_matches_schema(tmp_path: Path) -> None:
    version = flatc.installed_version()
    if version is None:
        pytest.skip("flatc is not installed (Debian package flatbuffers-compiler)")
    if version != flatc.FLATC_VERSION:
        pytest.skip(
            f"installed flatc {version} is not the pinned {flatc.FLATC_VERSION}: "
            "its output legitimately differs"
        )
    flatc.generate(tmp_path)
    fresh, committed = _files(tmp_path), _files(flatc.GENERATED_DIR)
    assert sorted(fresh) == sorted(committed), (
        "generated file set differs: run python -m sbpstream.protocol.flatc"
    )
    for name, data in fresh.items():
        assert committed[name] == data, (
            f"{name} is stale: run `python -m sbpstream.protocol.flatc` and commit the result"
        )


def test_schema_is_packaged() -> None:
    assert flatc.SCHEMA_PATH.is_file()
    assert (flatc.GENERATED_DIR / "sbp_generated.py").is_file()
