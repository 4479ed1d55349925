"""Docs that run: every code block of README.md and docs/*.md meant to be run is run here.

The convention (also in README.md, "Development"):

* Every fenced block names its language. ``bash``, ``sh``, ``shell`` and ``console`` blocks are
  shell and run; ``python`` blocks run; any other language (``text`` for diagrams, synopses and
  sample output, ``sql``, ...) is for reading only. An untagged fence fails
  :func:`test_every_block_says_whether_it_runs`.
* A runnable block that cannot run here is marked by an HTML comment on the line before it,
  ``<!-- no-run: why -->`` (a foreground server, a real multi-host setup, the whole suite, ...).
* Shell blocks run one by one, in page order, each in ``bash -eo pipefail`` from the repository
  root, with the virtualenv's ``bin`` first on PATH. In ``console`` blocks only ``$ `` lines run.
* A page's python blocks run after its shell blocks, in page order, in one fresh interpreter (a
  session, as a reader pastes them into ``python -m asyncio``: top-level ``await`` works, and a
  later block sees the names of earlier ones). A traceback names the page and its line.
* Both run against a live local cluster (:class:`sbpstream.cluster.LocalCluster`, one per page)
  as if it were the default one: the default PM address ``127.0.0.1:12378`` written in a block is
  replaced by the cluster's, and ``$SBPSTREAM_PM`` (and ``$PM``) are set to it.
* The pages of :data:`SECURE_PAGES` run against a cluster as ``sbpstream up --secure`` makes it
  (TLS, auth, the admin user) with the exports it prints set (``SBPSTREAM_USER``,
  ``SBPSTREAM_PASSWORD``, ``SBPSTREAM_TLS_CA``), and the admin HTTP ports ``up`` opens by
  default (``127.0.0.1:12380`` for the PM, ``12381`` for data node 0) replaced by the cluster's.

A small collector rather than mktestdocs: mktestdocs runs every block of a language the same
way (python ``exec``'d in the test process, bash without an environment), with no per-block
skip marker, no shared python session across a page's blocks and no address substitution.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.config import CA_FILE
from sbpstream.client.types import DEFAULT_PM
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = frozenset({"bash", "sh", "shell", "console"})
PYTHON = frozenset({"python"})
NO_RUN = re.compile(r"<!--\s*no-run\b.*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")
BLOCK_TIMEOUT_S = 120.0  # a hang guard per block (or per page's python session), not a timing

pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    lang: str
    source: str
    no_run: bool

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in SHELL | PYTHON and not self.no_run


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, lang = m["fence"], m["info"].strip().split(" ")[0].lower()
        prev = next((s for s in reversed(lines[:i]) if s.strip()), "")
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(s[len(m["indent"]):] for s in lines[start:j])
        out.append(Block(page, start + 1, lang, body + "\n", bool(NO_RUN.search(prev))))
        i = j + 1
    return out


def _shell_script(block: Block) -> str:
    if block.lang != "console":
        return block.source
    return "".join(s[2:] + "\n" for s in block.source.splitlines() if s.startswith("$ "))


def _env(pm: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "SBPSTREAM_PM": pm, "PM": pm, "PYTHONUNBUFFERED": "1"}


# The python session: each block compiled with the page's file name and line numbers, top-level
# await allowed (as in `python -m asyncio`), run in one namespace.
SESSION = r"""
import ast, asyncio, inspect, json, sys
ns = {"__name__": "__main__"}
loop = asyncio.new_event_loop()
for b in json.load(sys.stdin):
    code = compile("\n" * (b["line"] - 1) + b["source"], b["where"], "exec",
                   flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, ns)
    if inspect.iscoroutine(result):
        loop.run_until_complete(result)
"""


SECURE_PAGES = frozenset({"security.md"})
"""Pages whose examples need authentication: run against a secure cluster."""
UP_ADMIN_PORT = 12380
"""``sbpstream up``'s default admin port (the PM's; data node i: + 1 + i), as pages write it."""
DOCS_ADMIN = ("admin", "docs-admin-password")


def run_page(page: Path, pm: str, extra_env: dict[str, str] | None = None,
             admin_port: int | None = None) -> None:
    runnable = [b for b in blocks(page) if b.runs]
    env = {**_env(pm), **(extra_env or {})}

    def subst(source: str) -> str:
        source = source.replace(DEFAULT_PM, pm)
        if admin_port is not None:
            for i in (1, 0):  # data node 0's port first: "12381" is not a prefix of "12380"
                source = source.replace(f"127.0.0.1:{UP_ADMIN_PORT + i}",
                                        f"127.0.0.1:{admin_port + i}")
        return source

    for b in (b for b in runnable if b.lang in SHELL):
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", subst(_shell_script(b))],
                           cwd=ROOT, env=env, capture_output=True, timeout=BLOCK_TIMEOUT_S,
                           check=False)
        assert r.returncode == 0, (f"{b.where}: exit {r.returncode}\n{b.source}\n"
                                   f"stdout:\n{r.stdout.decode()}\nstderr:\n{r.stderr.decode()}")
    session = [{"where": _name(b.page), "line": b.line, "source": subst(b.source)}
               for b in runnable if b.lang in PYTHON]
    if session:
        r = subprocess.run([sys.executable, "-c", SESSION], input=json.dumps(session).encode(),
                           cwd=ROOT, env=env, capture_output=True, timeout=BLOCK_TIMEOUT_S,
                           check=False)
        assert r.returncode == 0, (f"{_name(page)}: python blocks failed\n"
                                   f"stdout:\n{r.stdout.decode()}\nstderr:\n{r.stderr.decode()}")


def test_every_block_says_whether_it_runs() -> None:
    untagged = [b.where for page in PAGES for b in blocks(page) if not b.lang]
    assert not untagged, f"fenced blocks without a language (use text if not run): {untagged}"
    marked = [b.where for page in PAGES for b in blocks(page)
              if b.no_run and b.lang not in SHELL | PYTHON]
    assert not marked, f"no-run marker on a block that would not run anyway: {marked}"


def test_the_collector_reads_fences_and_markers() -> None:
    found = blocks(ROOT / "README.md")
    assert [b.lang for b in found] == ["sh", "sh", "sh"]
    assert [b.runs for b in found] == [False, True, False]
    assert found[1].source.startswith("source .venv/bin/activate\n")


def test_a_broken_example_fails_and_names_its_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n```python\nprint(Record)\n```\n\n"
                    "<!-- no-run: would fail -->\n```sh\nfalse\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)page\.md\", line 8.*NameError: name 'Record'"):
        run_page(page, DEFAULT_PM)
    page.write_text("```sh\necho ok $SBPSTREAM_PM\nfalse\necho unreachable\n```\n")
    with pytest.raises(AssertionError, match=r"page\.md:2: exit 1"):
        run_page(page, DEFAULT_PM)


RUNNABLE_PAGES = [p for p in PAGES if any(b.runs for b in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[p.name for p in RUNNABLE_PAGES])
def test_doc_examples_run(page: Path, tmp_path: Path) -> None:
    if page.name not in SECURE_PAGES:
        with LocalCluster(tmp_path / "cluster", datanodes=2) as cluster:
            run_page(page, cluster.pm_address)
        return
    certs = tmp_path / "certs"
    init_dev_certs(certs)
    port = free_port()
    with LocalCluster(tmp_path / "cluster", datanodes=2, secure=certs,
                      metrics_port=port) as cluster:
        asyncio.run(bootstrap_admin(cluster.pm_address, certs, *DOCS_ADMIN))
        run_page(page, cluster.pm_address, admin_port=port, extra_env={
            "SBPSTREAM_USER": DOCS_ADMIN[0], "SBPSTREAM_PASSWORD": DOCS_ADMIN[1],
            "SBPSTREAM_TLS_CA": str(certs / CA_FILE)})
