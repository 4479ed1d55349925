"""Regenerate the committed FlatBuffers code from ``schema/sbp.fbs`` (a developer tool).

The generated code is not on the runtime path (``messages`` binds its classes to the schema with
``fbtable``); the tests use it as an independent reader of what ``fbtable`` writes.

``python -m sbpstream.protocol.flatc`` rewrites ``sbpstream/protocol/fbs/`` with the installed
``flatc`` (Debian ``flatbuffers-compiler``). Generated code differs between flatc versions, so the
committed code is made by :data:`FLATC_VERSION` and ``tests/test_schema_regen.py`` checks it only
when that version is installed.

``--gen-onefile`` puts every table in one module (``fbs/sbp_generated.py``): the per-file layout
imports its siblings as the top-level package ``sbp.fbs``, which does not exist here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

FLATC_VERSION: Final = "2.0.8"
"""The flatc that generated the committed code (``flatc --version``: "flatc version 2.0.8")."""

PROTOCOL_DIR: Final = Path(__file__).resolve().parent
SCHEMA_PATH: Final = PROTOCOL_DIR / "schema" / "sbp.fbs"
GENERATED_DIR: Final = PROTOCOL_DIR / "fbs"
FLATC_ARGS: Final = ("--python", "--gen-onefile")


def installed_version(flatc: str = "flatc") -> str | None:
    """The installed flatc's version ("2.0.8"), or None when there is no flatc."""
    exe = shutil.which(flatc)
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else None


def generate(out_dir: Path, flatc: str = "flatc") -> None:
    """Run flatc on the schema, writing the Python package into ``out_dir``."""
    exe = shutil.which(flatc)
    if exe is None:
        raise FileNotFoundError(f"{flatc} not found: install Debian's flatbuffers-compiler")
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([exe, *FLATC_ARGS, "-o", str(out_dir), str(SCHEMA_PATH)], check=True)


def main() -> int:
    version = installed_version()
    if version != FLATC_VERSION:
        print(
            f"flatc {version or 'missing'}; the committed code is pinned to {FLATC_VERSION}",
            file=sys.stderr,
        )
        return 1
    shutil.rmtree(GENERATED_DIR, ignore_errors=True)
    generate(GENERATED_DIR)
    print(f"regenerated {GENERATED_DIR} from {SCHEMA_PATH.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
