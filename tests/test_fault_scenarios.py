"""Issue 33's fault scenarios in the network test bed (the 20-cycle soaks, one fresh cluster per
scenario, are ``bench/bench_faults.py``). Here each store's cluster goes through every scenario
that applies to it, one cycle each, in turn under one workload (``tests/workload.py``: streams
of replication factor 2 and 3 on four data nodes), then checks what
:func:`faultbed.exercise` collects: nothing acknowledged lost or duplicated, no send failed
with deadline left at the heal, no call past its deadline, ``sbpstream check`` clean, and with
etcd no write of a deposed PM leader after its successor's. A rolling restart of every server
and a drain run the same way. The SQLite cluster runs with TLS and authentication on (the
certificates name every host's address; the workload logs in as the administrator), the etcd
one without."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
from faultbed import SCENARIOS, ScenarioResult, run_drain, run_rolling_restart, run_scenarios
from netbed import require_root

pytestmark = [pytest.mark.adversity, pytest.mark.timeout(900)]

SQLITE_SCENARIOS: Final = [name for name, sc in SCENARIOS.items() if not sc.etcd_only]
ETCD_SCENARIOS: Final = list(SCENARIOS)


def _assert_ok(result: ScenarioResult) -> None:
    assert result.check.get("acked", 0) > 0, result.check
    assert result.ok, "\n".join(result.failures())


def test_every_scenario_runs_in_the_suite() -> None:
    assert set(ETCD_SCENARIOS) == set(SCENARIOS)
    assert {n for n in SCENARIOS if SCENARIOS[n].etcd_only} == {
        "leader-cut-from-etcd", "etcd-member-isolated"}


ETCD_WATCH_STALL: Final = (
    "open (issue 33, docs/operations.md 'Fault soak'): after repeated etcd faults every PM's "
    "metadata watch can stop delivering, and then no PM is elected")
"""Why the etcd run may fail today; it runs every time, and passes when the stall does not
happen (XPASS)."""


@pytest.mark.parametrize(("metadata", "scenarios", "secure"), [
    ("sqlite", SQLITE_SCENARIOS, True),  # TLS and authentication on every connection
    pytest.param("etcd", ETCD_SCENARIOS, False,
                 marks=pytest.mark.xfail(strict=False, reason=ETCD_WATCH_STALL)),
], ids=["sqlite-secure", "etcd"])
def test_every_scenario_in_turn_loses_nothing(metadata: str, scenarios: list[str],
                                              secure: bool, tmp_path: Path) -> None:
    require_root()
    _assert_ok(run_scenarios(tmp_path, scenarios, metadata=metadata, cycles=1, secure=secure))


def test_a_rolling_restart_of_every_server_loses_nothing(tmp_path: Path) -> None:
    """Data nodes, then the three PMs, then the etcd members, one at a time under load."""
    require_root()
    _assert_ok(run_rolling_restart(tmp_path, metadata="etcd"))


def test_a_drained_node_is_removed_with_nothing_under_replicated(tmp_path: Path) -> None:
    require_root()
    _assert_ok(run_drain(tmp_path, metadata="sqlite"))
