"""Shared test setup: asyncio tests run on uvloop, as the servers and SDK do; and every test is
put in exactly one tier from what it uses.

Tiers (markers, registered in pyproject.toml):

* ``spark``: needs the JVM (the ``spark`` fixture, a SparkSession);
* ``adversity``: injects a fault: the fault proxy (:class:`tcp_proxy.TcpProxy` in the test or
  one of its fixtures, ``set_faults``, ``cut``), kill -9, SIGSTOP (``kill``, ``pause``,
  ``SIGKILL``, ``SIGSTOP``);
* ``integration``: real processes, sockets or files (LocalCluster, a PM or data node process,
  etcd: any ``Etcd*`` class or ``*etcd*`` fixture, a ``Server``/``Connection`` on loopback,
  subprocess, a ``tmp_path`` or ``tempfile`` directory: the store engine and the SQLite
  metadata tests live here);
* ``unit``: everything else, in-process and pure, the seconds tier: ``pytest -m unit``.

"What a test uses" is read from code, not declared: the names the test function refers to, and
those of the module-level helpers it calls, for the fault signals; for the process/socket
signals also everything its fixtures (recursively) and the helper classes of the test modules
refer to. A tier marker written on a test by hand wins. A ``unit`` test that nevertheless opens
a socket or starts a process fails at once (see :func:`_unit_tests_stay_pure`), so the
classifier cannot silently put a networked test in the fast tier.

``make unit`` runs the unit tier, ``make tier TIER=...`` one tier, ``make suite`` all of them.

Warnings are errors (pyproject.toml), ``ResourceWarning`` included: a test closes what it opens
(sockets, transports, files, a subprocess's pipes: ``with subprocess.Popen(...)``). To find
where an unclosed resource was made, run the module with ``PYTHONTRACEMALLOC=20``.

Helpers shared by test modules live once, in support modules here (import them, do not copy):
``waiting`` (bounded waits: ``eventually``, ``eventually_async``), ``raw_sbp`` (create, append
and fetch over one SBP connection), ``raw_peer`` (hand-built frames, a blocking socket peer),
``cluster_helpers`` (PM processes, reading a range from a replica, secure clusters and clients),
``metadata_backends`` (the SQLite and etcd metadata stores behind one ``backend`` fixture),
``etcd_fixture``, ``tcp_proxy`` (the fault proxy).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop

TIERS = ("unit", "integration", "adversity", "spark")
TESTS_DIR = Path(__file__).resolve().parent

SPARK_FIXTURES = frozenset({"spark"})
SPARK_NAMES = frozenset({"SparkSession", "pyspark"})
FAULT_NAMES = frozenset({"TcpProxy", "set_faults", "cut", "kill", "pause", "SIGKILL", "SIGSTOP"})
FAULT_FIXTURE_NAMES = frozenset({"TcpProxy"})
DISK_FIXTURES = frozenset({"tmp_path", "tmp_path_factory", "tmpdir", "tmpdir_factory"})
DISK_NAMES = frozenset({"tempfile", "mkdtemp", "TemporaryDirectory", "NamedTemporaryFile"})
PROCESS_NAMES = frozenset({
    "LocalCluster", "Node", "Server", "Connection", "ConnectionPool", "AsyncClient",
    "EtcdServer", "TcpProxy", "Popen", "subprocess", "socket", "open_connection",
    "start_server", "create_connection", "urlopen",
})


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    return {"uvloop": uvloop.new_event_loop}


# ------------------------------------------------------------------------------ classification


def _is_ours(obj: object) -> bool:
    """A function or class defined in a file of tests/ other than this one (helpers and
    fixtures we look inside; this file's own guard fixture names what it refuses)."""
    try:
        source = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    if source is None:
        return False
    path = Path(source).resolve()
    return path.parent == TESTS_DIR and path != Path(__file__).resolve()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _names_used(obj: object, *, into_classes: bool, seen: set[int] | None = None) -> set[str]:
    """Global and attribute names ``obj`` (a function or class) refers to, followed through the
    module-level functions (and, with ``into_classes``, classes) of tests/ it names."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    if isinstance(obj, type):
        if not into_classes:
            return set()
        out: set[str] = set()
        for member in vars(obj).values():
            fn = getattr(member, "__func__", member)
            fn = getattr(fn, "fget", fn)
            if isinstance(fn, types.FunctionType):
                out |= _names_used(fn, into_classes=into_classes, seen=seen)
        return out
    fn = inspect.unwrap(obj)  # type: ignore[arg-type]
    code = getattr(fn, "__code__", None)
    if code is None:
        return set()
    names = {n for c in _codes(code) for n in c.co_names}
    module_globals: dict[str, Any] = getattr(fn, "__globals__", {})
    targets = [module_globals.get(name) for name in names]
    # closures too: hypothesis' state machine TestCase reaches its machine class through one
    targets += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or ()
                if cell.cell_contents is not None]
    for target in targets:
        if (isinstance(target, types.FunctionType | type) and target is not obj
                and _is_ours(target)):
            names |= _names_used(target, into_classes=into_classes, seen=seen)
    return names


def _fixture_closure_names(item: pytest.Item) -> tuple[set[str], set[str]]:
    """(fixture names, names used by those fixtures' functions)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set(), set()
    fixtures = set(info.names_closure)
    used: set[str] = set()
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            func = fixturedef.func
            if _is_ours(func):
                used |= _names_used(func, into_classes=True)
    return fixtures, used


def tier_of(item: pytest.Item) -> str:
    """The one tier of a collected test (see the module docstring)."""
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            return tier
    func = getattr(item, "function", None)
    if func is None:
        return "unit"
    own = _names_used(func, into_classes=False)
    fixtures, fixture_used = _fixture_closure_names(item)
    everything = own | fixture_used | _names_used(func, into_classes=True)
    if fixtures & SPARK_FIXTURES or everything & SPARK_NAMES:
        return "spark"
    if own & FAULT_NAMES or fixture_used & FAULT_FIXTURE_NAMES:
        return "adversity"
    if (everything & (PROCESS_NAMES | DISK_NAMES) or fixtures & DISK_FIXTURES
            or any("Etcd" in n for n in everything) or any("etcd" in f for f in fixtures)):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))


# ------------------------------------------------------------------------------- unit purity


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"a test of the unit tier used {what}: it belongs in the integration tier "
            "(teach tests/conftest.py the name that gives it away, or mark it by hand)")

    return refuse


@pytest.fixture(autouse=True)
def _unit_tests_stay_pure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Unit tests may not open sockets or start processes."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for cls, attr in ((socket.socket, "connect"), (socket.socket, "bind"),
                          (socket.socket, "connect_ex")):
            mp.setattr(cls, attr, _refuse(f"socket.{attr}"))
        mp.setattr(socket, "create_connection", _refuse("socket.create_connection"))
        mp.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))
        mp.setattr(asyncio, "open_connection", _refuse("asyncio.open_connection"))
        mp.setattr(asyncio, "start_server", _refuse("asyncio.start_server"))
        from sbpstream.net.client import Connection
        from sbpstream.net.server import Server

        mp.setattr(Connection, "open", _refuse("Connection.open"))
        mp.setattr(Server, "start", _refuse("Server.start"))
        yield
