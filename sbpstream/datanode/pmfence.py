"""The PM leadership epoch a data node has seen, kept on disk: the fence against a deposed PM.

With several PMs on etcd, each leader seals ranges with its **epoch**, the fencing token it won
the election with (the leader key's ``create_revision``, strictly increasing from one leader to
the next). A leader that pauses (GC, VM stop, SIGSTOP) past its lease may resume while it
still believes it leads; its metadata writes are refused by etcd's fence, but SEAL_RANGES goes
to data nodes *before* the metadata write. Without this fence such a PM could end a range on a
replica at another end than its successor chose, and that replica would then differ from the
sealed range for good.

So a data node remembers the highest epoch any SEAL_RANGES carried and refuses a lower one
with FENCED_LEADER. The highest epoch is written to ``DIR/pm_epoch`` (atomically, fsynced)
before a seal of a new epoch is carried out, so a restart of the node does not reopen the
window. Epoch 0 is a PM without an election (SQLite metadata): one PM, nothing to fence.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Final

from sbpstream.protocol.errors import FencedLeaderError

log = logging.getLogger("sbpstream.datanode")

PM_EPOCH_FILE: Final = "pm_epoch"
"""File in the node's directory holding the highest PM epoch seen (JSON, versioned)."""

PM_EPOCH_FORMAT: Final = 1
"""Format version of :data:`PM_EPOCH_FILE`; a newer one is refused rather than misread."""


class PmEpochFence:
    """The highest PM epoch seen by this node, durable in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / PM_EPOCH_FILE
        self.highest = self._load()

    def _load(self) -> int:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            raise RuntimeError(
                f"{self.path} is unreadable ({exc}): restore it from a backup, or delete it "
                "if every PM of the cluster runs without etcd") from exc
        version = int(data.get("format", 1)) if isinstance(data, dict) else -1
        if version != PM_EPOCH_FORMAT or not isinstance(data.get("epoch"), int):
            raise RuntimeError(
                f"{self.path} has format {version}, this build reads format {PM_EPOCH_FORMAT}: "
                "run the sbpstream release that wrote it")
        return int(data["epoch"])

    def admit(self, epoch: int) -> None:
        """Raise :class:`FencedLeaderError` for an epoch below the highest seen; remember (on
        disk first) an epoch above it."""
        if epoch < self.highest:
            raise FencedLeaderError(
                f"seal from PM epoch {epoch}, but a PM of epoch {self.highest} has led since: "
                "the sender was deposed (it redirects to the current leader)")
        if epoch > self.highest:
            self._save(epoch)
            log.info("event=pm_epoch_advanced from=%d to=%d", self.highest, epoch)
            self.highest = epoch

    def _save(self, epoch: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": PM_EPOCH_FORMAT, "epoch": epoch}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
