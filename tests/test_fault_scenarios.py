"""Issue 33's fault scenarios in the network test bed, a few cycles each (the 20-cycle soaks are
``bench/bench_faults.py``). Each runs the workload of ``tests/workload.py`` (streams of
replication factor 2 and 3 on four data nodes) through cycles of fault and heal, then checks
what :func:`faultbed.run_scenario` collects: nothing acknowledged lost or duplicated, no send
failed with deadline left at the heal, no call past its deadline, ``sbpstream check`` clean,
and with etcd no write of a deposed PM leader after its successor's."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
from faultbed import SCENARIOS, run_drain, run_rolling_restart, run_scenario
from netbed import require_root

pytestmark = [pytest.mark.adversity, pytest.mark.timeout(600)]

CYCLES: Final = 2
"""Cycles per scenario in the suite: one fault and heal, then a second on a cluster that has
been through one (the soak runs 20)."""

CASES: Final = [
    ("dn-isolated", "sqlite"),
    ("dn-cut-from-pm", "etcd"),
    ("client-cut-from-dn", "sqlite"),
    ("pm-cut-from-dns", "etcd"),
    ("leader-cut-from-etcd", "etcd"),
    ("halves", "etcd"),
    ("flaky-link", "sqlite"),
    ("pm-leader-paused", "etcd"),
    ("primary-paused", "sqlite"),
    ("etcd-member-isolated", "etcd"),
]
"""Each scenario once in the suite, on the metadata store where it bites hardest (the leader
scenarios need etcd); the soak runs every scenario on both."""


def test_every_scenario_is_in_the_suite() -> None:
    assert sorted(name for name, _ in CASES) == sorted(SCENARIOS)


@pytest.mark.parametrize(("scenario", "metadata"), CASES)
def test_scenario_loses_nothing(scenario: str, metadata: str, tmp_path: Path) -> None:
    require_root()
    result = run_scenario(tmp_path, scenario, metadata=metadata, cycles=CYCLES)
    assert result.check.get("acked", 0) > 0, result.check
    assert result.ok, "\n".join(result.failures())


def test_a_rolling_restart_of_every_server_loses_nothing(tmp_path: Path) -> None:
    """Data nodes, then the three PMs, then the etcd members, one at a time under load."""
    require_root()
    result = run_rolling_restart(tmp_path, metadata="etcd")
    assert result.check.get("acked", 0) > 0, result.check
    assert result.ok, "\n".join(result.failures())


def test_a_drained_node_is_removed_with_nothing_under_replicated(tmp_path: Path) -> None:
    require_root()
    result = run_drain(tmp_path, metadata="sqlite")
    assert result.check.get("acked", 0) > 0, result.check
    assert result.ok, "\n".join(result.failures())
