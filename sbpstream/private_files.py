"""Owner-only files and directories (docs/security.md, Safe defaults).

Secrets, keys, the PM's metadata (it holds SCRAM verifiers) and data directories (segments) are
created readable by their owner only, whatever the umask: a file is opened with mode 0600 and
then ``fchmod``-ed (the umask only ever removes bits, so the explicit chmod is what makes the
mode exact), a directory made 0700 the same way. :func:`refuse_shared` is the startup check that
a secret or key file is not readable by group or others.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Final

PRIVATE_FILE_MODE: Final = 0o600
"""Read and write for the owner, nothing for group and others (as ssh wants of a key)."""
PRIVATE_DIR_MODE: Final = 0o700
"""Enter, list and create for the owner only: what is inside stays unreadable to others even
when a file in it was made with a looser mode."""


def private_dir(path: Path) -> Path:
    """Make ``path`` (and missing parents) a directory; one this call creates gets mode 0700.
    An existing directory keeps its mode (the operator may have chosen it)."""
    path = Path(path)
    if path.is_dir():
        return path
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR_MODE)
    return path


def open_private(path: Path | str, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` whose file ends with mode 0600 (a file that already
    existed is tightened to 0600 too: only our own files go through here)."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) with mode 0600."""
    fd = open_private(path, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def refuse_shared(path: str, flag: str) -> None:
    """ValueError naming the file and the fix when ``path`` is readable by group or others, or
    cannot be read by us. ``flag`` names where the path came from (``--secret-file``)."""
    try:
        st = os.stat(path)
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror}); check the path and "
                         f"that this user owns it") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{flag} {path}: readable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}); it holds a secret: "
                         f"run `chmod 600 {path}`")
