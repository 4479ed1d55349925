"""The ``sbpstream`` application: the root command with its global options, and the helpers
every command family shares (one client, one-line errors, the wait reporter).

Global options (before the command): ``--pm HOST:PORT[,HOST:PORT...]`` (or ``$SBPSTREAM_PM``;
default ``127.0.0.1:12378``), ``--timeout-ms``, ``--user``, ``--password``, ``--token-file``,
``--tls-ca``; every client command also takes ``--pm`` and ``--timeout-ms`` after its name (its
own wins). Expected failures (unreachable PM, unknown stream, bad offset, bad
arguments) are reported as one line on stderr with a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Coroutine, Sequence
from typing import Annotated, Any, Final, NoReturn, TypeVar, cast

import typer
from rich.console import Console
from typer.exceptions import TyperException

from sbpstream.client import AsyncClient
from sbpstream.client.retry import backoff_observers
from sbpstream.client.types import (
    DEFAULT_PM,
    PM_ENV,
    Compression,
    codec_of,
    pm_addresses,
)
from sbpstream.introspect.wire import CALL_TIMEOUT_S, Introspection
from sbpstream.net.loop import run
from sbpstream.net.tls import TlsFileError
from sbpstream.protocol.errors import (
    ClientErrorCode,
    ErrorCode,
    SbpError,
)
from sbpstream.protocol.messages import DescribeStreamsRequest, DescribeStreamsResponse
from sbpstream.protocol.names import name_problem

T = TypeVar("T")

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
READ_CHUNK_BYTES = 1 << 16  # stdin is read in chunks; the lines of a chunk go in one call

err_console = Console(stderr=True, highlight=False)
NON_TTY_WIDTH: Final = 10_000
"""Output width when stdout is not a terminal (and $COLUMNS is not set): tables as wide as their
content (rich would cut them at 80 columns), so a pipe or a file gets whole rows."""
out_console = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ
                      else NON_TTY_WIDTH)

app = typer.Typer(
    name="sbpstream",
    help="sbpstream: distributed stream storage. Run a local cluster with `sbpstream up`, then "
    "create streams, produce and consume records from another terminal.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

DEFAULT_TIMEOUT_MS: Final = 15_000
"""How long a client command retries (an unreachable PM, a node restarting) before it gives up:
long enough to ride out a PM failover or a data node restart under `up`."""
UNSET: Final = -1
"""A per-command --timeout-ms not given: the global one (or the command's default) applies."""

GLOBAL: dict[str, Any] = {"pm": "", "timeout_ms": None}
"""The global options of this invocation (set by the root callback, before any command's own
options are read): a command's --pm / --timeout-ms, when not given, fall back to these."""


def _pm_here(value: str) -> str:
    """A command's --pm: its own when given, else the global --pm ($SBPSTREAM_PM, default)."""
    return value or GLOBAL["pm"] or os.environ.get(PM_ENV) or DEFAULT_PM


def timeout_or(default_ms: int) -> Callable[[int], int]:
    """A command's --timeout-ms: its own when given, else the global one, else ``default_ms``."""

    def resolve(value: int) -> int:
        if value != UNSET:
            return value
        given = GLOBAL["timeout_ms"]
        return default_ms if given is None else int(given)

    return resolve


PmOption = Annotated[str, typer.Option(
    "--pm", callback=_pm_here, show_default=False,
    help="Placement manager address(es), HOST:PORT[,HOST:PORT...] (default: the global --pm, "
    f"${PM_ENV}, {DEFAULT_PM}).")]
TimeoutOption = Annotated[int, typer.Option(
    "--timeout-ms", callback=timeout_or(DEFAULT_TIMEOUT_MS), show_default=False,
    help=f"Give up retrying after this many ms (default: the global --timeout-ms, "
    f"{DEFAULT_TIMEOUT_MS}).")]


class CliError(Exception):
    """An expected failure: reported as one line, exit status 1."""


# SDK wording -> the CLI's own words, for hints raised by the SDK but shown by the CLI
_CLI_WORDS = (
    ("use auto_reset='earliest' to jump to the start", "use --from earliest to start there"),
)


def cli_words(message: str) -> str:
    for sdk, cli in _CLI_WORDS:
        message = message.replace(sdk, cli)
    return message


def one_line(message: str) -> str:
    """Errors are one line: a multi-line message (a server's, a library's) is joined."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")  # over a live progress line, if any
    err_console.print(f"sbpstream: error: {one_line(cli_words(message))}", markup=False,
                      soft_wrap=True)
    raise typer.Exit(code)


said_on_command_line = {"interrupted": False}


def interrupted(message: str = "sbpstream: interrupted") -> NoReturn:
    """Ctrl-C: one line, exit status 130."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")
    err_console.print(message, markup=False)
    said_on_command_line["interrupted"] = True
    raise typer.Exit(EXIT_INTERRUPTED)


def explain(exc: SbpError, pm: str) -> str:
    """The error's message, with its likely cause when the SDK's words do not say it."""
    text = str(exc)
    if exc.code == ErrorCode.UNSUPPORTED_OPERATION and "datanode" in text:
        return (f"--pm {pm} points at a data node, not a placement manager ({text}); "
                f"`sbpstream up` prints the PM address (default {DEFAULT_PM})")
    last = waiting.last
    if (exc.code in (ClientErrorCode.CONNECTION_CLOSED, ClientErrorCode.CLIENT_TIMEOUT)
            and last is not None and last[0] == "data node"):
        return (f"{text} (the data node at {last[1]} looks down: {last[2]}; "
                "`sbpstream stream ranges ID` shows which nodes hold the stream)")
    return text


_ADDRESS = re.compile(r"(\[[0-9a-fA-F:]+\]:\d+|[A-Za-z0-9_.-]+:\d+)")


class WaitReporter:
    """Says on stderr what a command is waiting for once the SDK has retried for ~1 s.

    Fed by the SDK's backoff hook (from the client's event-loop thread): ``waiting for the
    placement manager at 127.0.0.1:1 (connection refused), 3 s of 15 s``. Remembers the last
    thing waited for, so a final error can name the likely cause.
    """

    FIRST_S = 1.0  # quiet for short hiccups
    EVERY_S = 2.0  # then one line per this many seconds

    def __init__(self) -> None:
        self.pm: set[str] = set()
        self.last: tuple[str, str, str] | None = None  # (what, address, cause)
        self._last_line = 0.0

    def use_pm(self, pm: str) -> None:
        try:
            self.pm = set(pm_addresses(pm))
        except ValueError:
            self.pm = set()

    def describe(self, err: BaseException) -> tuple[str, str, str]:
        msg = getattr(err, "message", str(err))
        m = _ADDRESS.search(msg)
        addr = m.group(1) if m else ""
        cause = _cause_of(err)
        if addr and addr in self.pm:
            return "placement manager", addr, cause
        if addr:
            return "data node", addr, cause
        if isinstance(err, SbpError) and err.code == ErrorCode.NOT_ENOUGH_DATA_NODES:
            return "enough live data nodes", "", cause
        return "a retry", "", cause

    def __call__(self, err: BaseException, elapsed_s: float, deadline_s: float) -> None:
        what, addr, cause = self.last = self.describe(err)
        now = time.monotonic()
        if elapsed_s < self.FIRST_S or now - self._last_line < self.EVERY_S:
            return
        self._last_line = now
        target = f"the {what} at {addr}" if addr else what
        sys.stderr.write(f"waiting for {target} ({cause}), {elapsed_s:.0f} s of "
                         f"{deadline_s:.0f} s\n")
        sys.stderr.flush()


def _cause_of(err: BaseException) -> str:
    root = err.__cause__
    if isinstance(root, TimeoutError):
        return "no answer"
    if isinstance(root, OSError) and root.errno:
        return os.strerror(root.errno).lower()
    if isinstance(err, SbpError):
        return f"{err.code.name}: {err.message}"
    return str(err)


waiting = WaitReporter()


class LiveCount:
    """A live ``N records, R records/s`` line on stderr, only when stderr is a terminal."""

    AFTER_S = 1.0  # short work shows nothing
    EVERY_S = 0.25

    def __init__(self, verb: str, enabled: bool | None = None) -> None:
        self.verb = verb
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.count = 0
        self._t0 = time.monotonic()
        self._next = self._t0 + self.AFTER_S
        self._shown = False

    def add(self, n: int) -> None:
        self.count += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.EVERY_S
        rate = self.count / max(now - self._t0, 1e-9)
        sys.stderr.write(f"\r\x1b[K{self.verb} {self.count:,} records, {rate:,.0f} records/s")
        sys.stderr.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._shown = False


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sbpstream")
    except PackageNotFoundError:
        from sbpstream import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"sbpstream {_version()}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
                       ] = False,
    user: Annotated[str, typer.Option("--user", help="Authenticate as this user "
                                      "(env SBPSTREAM_USER).")] = "",
    password: Annotated[str, typer.Option("--password", help="The user's password "
                                          "(env SBPSTREAM_PASSWORD).")] = "",
    token_file: Annotated[str, typer.Option("--token-file", help="Authenticate with the token "
                                            "in this file (env SBPSTREAM_TOKEN_FILE).")] = "",
    tls_ca: Annotated[str, typer.Option("--tls-ca", help="Connect over TLS, verifying servers "
                                        "against this CA (env SBPSTREAM_TLS_CA).")] = "",
    pm: Annotated[str, typer.Option(
        "--pm", envvar=PM_ENV, show_envvar=False,
        help=f"Placement manager address(es), HOST:PORT[,HOST:PORT...] (env {PM_ENV}); every "
        "client command also takes it after its name.")] = DEFAULT_PM,
    timeout_ms: Annotated[int | None, typer.Option(
        "--timeout-ms", min=1, show_default=False,
        help=f"Give up retrying after this many ms (default {DEFAULT_TIMEOUT_MS}; every client "
        "command also takes it after its name).")] = None,
) -> None:
    GLOBAL.update(pm=pm, timeout_ms=timeout_ms)
    # handed to the SDK through its environment variables (docs/security.md)
    for name, value in (("SBPSTREAM_USER", user), ("SBPSTREAM_PASSWORD", password),
                        ("SBPSTREAM_TOKEN_FILE", token_file), ("SBPSTREAM_TLS_CA", tls_ca)):
        if value:
            os.environ[name] = value


def make_client(pm: str, timeout_ms: int) -> AsyncClient:
    """The one client every command uses: --pm, and the credentials and CA given before the
    command (or by $SBPSTREAM_USER, _PASSWORD, _TOKEN_FILE, _TLS_CA)."""
    waiting.use_pm(pm)
    try:
        return AsyncClient(pm, retry_deadline_ms=timeout_ms,
                           request_timeout_ms=min(10_000, max(1000, timeout_ms)),
                           client_id=CLIENT_ID["id"])
    except TlsFileError as exc:
        fail(str(exc), EXIT_USAGE)
    except ValueError as exc:
        fail(f"--pm: {exc}", EXIT_USAGE)


class ClientIntrospection(Introspection):
    """INFO, STATS, CONNECTIONS and WHOAMI on the connection ``client`` keeps to ``address``
    (TLS, authenticated); the client closes it."""

    def __init__(self, client: AsyncClient, address: str,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        super().__init__(address, timeout_s)
        self.client = client

    async def __aenter__(self) -> ClientIntrospection:
        # the client's pool: TLS and credentials, no client-id HEARTBEAT (WHOAMI counts only
        # what the command asked)
        self._conn = await self.client.connection(self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._conn = None


async def pm_leader(client: AsyncClient) -> str:
    """The PM leader's address, found by the SDK's PM caller: every --pm address in turn, a
    follower's PM_NOT_LEADER redirect followed, retried until the client's deadline. The
    question is a DESCRIBE_STREAMS of one stream (cheap; the gate filters it, never refuses)."""
    await client.pm_request(DescribeStreamsRequest(timeout_ms=client.request_timeout_ms, limit=1),
                          DescribeStreamsResponse)
    return client.pm_leader or client.pm_addresses[0]


async def stream_names(client: AsyncClient, ids: Sequence[int]) -> dict[int, str]:
    """Stream id -> name for those of ``ids`` that have one ({} when the PM cannot say): one
    DESCRIBE_STREAMS through the SDK's PM caller; unknown or hidden ids are left out."""
    if not ids:
        return {}
    try:
        resp = await client.pm_request(
            DescribeStreamsRequest(timeout_ms=client.request_timeout_ms, stream_ids=tuple(ids)),
            DescribeStreamsResponse)
    except SbpError:
        return {}
    return {r.stream.stream_id: r.stream.name for r in resp.items
            if r.status.ok and r.stream is not None and r.stream.name}


def run_command(pm: str, timeout_ms: int,
                body: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
    """Run ``body(client)`` on a fresh event loop; expected errors become one line."""
    client = make_client(pm, timeout_ms)

    async def main() -> T:
        async with client:
            return await body(client)

    try:
        return run(main())
    except SbpError as exc:
        fail(explain(exc, pm))
    except CliError as exc:
        fail(str(exc))



CLIENT_ID_ENV = "SBPSTREAM_CLIENT_ID"
CLIENT_ID = {"id": os.environ.get(CLIENT_ID_ENV, "")}
"""The client id every client command sends (``--client-id ID`` anywhere on the command line
of a command other than ``quota``, or $SBPSTREAM_CLIENT_ID): the data nodes apply its quotas."""


def _take_client_id(argv: list[str]) -> list[str]:
    """Remove ``--client-id ID`` / ``--client-id=ID`` from a client command's arguments and
    remember it; ``quota`` commands keep theirs (there it names the quota's client)."""
    words = [a for a in argv if not a.startswith("-")]
    if words[:1] == ["quota"]:
        return argv
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--client-id":
            value = next(it, None)
            if value is None:
                fail("--client-id needs a value", EXIT_USAGE)
            CLIENT_ID["id"] = value
        elif a.startswith("--client-id="):
            CLIENT_ID["id"] = a.split("=", 1)[1]
        else:
            out.append(a)
    return out



def valid_pm(pm: str) -> None:
    waiting.use_pm(pm)
    try:
        pm_addresses(pm)
    except ValueError as exc:
        fail(f"--pm: {exc}", EXIT_USAGE)



# ------------------------------------------------------------------------------------- main


def stream_ref(text: str) -> int | str:
    """``--stream NAME|ID``: digits are an id, anything else a name (checked here, one line)."""
    problem = None if text.strip().isdigit() else name_problem(text)
    if problem is not None:
        raise CliError(f"--stream: {problem}")
    return text


def compression_of(name: str) -> Compression:
    try:
        codec_of(name)
    except ValueError as exc:
        fail(f"--compression: {exc}", EXIT_USAGE)
    return cast(Compression, name.lower())


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """Python warnings (the SDK's InsecureCredentialsWarning) as one line on stderr."""
    sys.stderr.write(f"sbpstream: warning: {one_line(str(message))}\n")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors, exit codes 0 / 1 (error) / 2 (usage) / 130."""
    backoff_observers.append(waiting)
    # the SDK's warnings (e.g. event=append_failed) are summed up by the command's own error line
    logging.getLogger("sbpstream.client").addHandler(logging.NullHandler())
    logging.getLogger("sbpstream.auth").addHandler(logging.NullHandler())  # warned below
    warnings.showwarning = _warning_line
    try:
        args = sys.argv[1:] if argv is None else argv
        rv = app(args=_take_client_id(list(args)), prog_name="sbpstream", standalone_mode=False)
    except TlsFileError as exc:  # from a client built outside make_client (produce, consume)
        err_console.print(f"sbpstream: error: {one_line(str(exc))}", markup=False,
                          soft_wrap=True)
        sys.exit(EXIT_USAGE)
    except TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help(), file=sys.stderr)
            sys.exit(EXIT_USAGE)
        err_console.print(f"sbpstream: error: {exc.format_message()}", markup=False,
                          soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        rv = EXIT_INTERRUPTED
    except typer.Exit as exc:
        rv = exc.exit_code
    if rv == EXIT_INTERRUPTED and not said_on_command_line["interrupted"]:
        # click turns a KeyboardInterrupt inside a command into exit status 130, silently
        with contextlib.suppress(KeyboardInterrupt):
            err_console.print("sbpstream: interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
