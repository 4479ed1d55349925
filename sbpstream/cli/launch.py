"""What every server command (``pm``, ``datanode``, ``kafka-gateway``) shares: where its
settings come from, its log format, and its signals.

Settings: each flag of a server command can be given four ways, the first that is set wins:

1. the flag on the command line (``--port 12378``);
2. an environment variable ``SBPSTREAM_<COMMAND>_<FLAG>``: the command and the flag in upper
   case, ``-`` as ``_`` (``SBPSTREAM_PM_PORT``, ``SBPSTREAM_DATANODE_FSYNC_INTERVAL_MS``,
   ``SBPSTREAM_KAFKA_GATEWAY_LISTENER``); a boolean flag takes ``1``/``true``/``0``/``false``;
3. a TOML file named by ``--config FILE`` (or ``SBPSTREAM_<COMMAND>_CONFIG``): one key per flag,
   spelled as the flag without its dashes (``port = 12378``, ``node-timeout-ms = 5000``;
   ``_`` works too), either at the top level or in a table named after the command (``[pm]``,
   ``[datanode]``, ``[kafka-gateway]``), which wins when present, so one file can serve all three;
4. the default ``--help`` shows.

Logs: one line per event on stderr, ``ts=... level=... logger=... event=...`` (key=value), or one
JSON object per line with ``--log-format json``; set up by :func:`setup_logging` only.

Signals: a server unblocks SIGINT, SIGTERM and SIGHUP first thing (:func:`unblock_signals`): a
parent that starts it while it holds them blocked (``sbpstream up`` restarting a server) must not
leave it deaf to the stop it will later send.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from typer.core import TyperCommand, TyperOption

from sbpstream.cli.app import EXIT_USAGE, fail

ENV_PREFIX: Final = "SBPSTREAM"
"""Every server setting's environment variable starts with this (then command, then flag)."""

SHARED_ENV: Final = {"log_level": "SBPSTREAM_LOG_LEVEL", "pm": "SBPSTREAM_PM"}
"""Variables read after the command's own, for every server: the log level, and the PM address
clients use too (so a data node or gateway started beside a client finds the same PM)."""

LOG_FORMATS: Final = ("kv", "json")
"""``kv``: ``key=value`` words (the default, greppable); ``json``: one object per line."""

_HELD_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def env_name(command: str, param: str) -> str:
    """``SBPSTREAM_PM_PORT`` for (``pm``, ``port``): the variable of one server setting."""
    return f"{ENV_PREFIX}_{command}_{param}".upper().replace("-", "_")


class ServerCommand(TyperCommand):
    """A server command: every option also reads ``SBPSTREAM_<COMMAND>_<FLAG>`` (listed in
    ``--help``), then the variables of :data:`SHARED_ENV`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if not isinstance(p, TyperOption) or p.name is None:
                continue
            names = [env_name(self.name or "", p.name)]
            if p.name in SHARED_ENV:
                names.append(SHARED_ENV[p.name])
            p.envvar = names
            p.show_envvar = True


def _config_keys(ctx: typer.Context) -> dict[str, str]:
    """TOML key (flag without dashes, or the parameter's name) -> parameter name."""
    keys: dict[str, str] = {}
    for p in ctx.command.params:
        if p.name is None or p.name == "config":
            continue
        keys[p.name] = p.name
        for opt in getattr(p, "opts", ()):
            keys[opt.lstrip("-")] = p.name
    return keys


def read_config(path: Path, command: str, keys: dict[str, str]) -> dict[str, Any]:
    """The settings of ``command`` in the TOML file ``path`` as {parameter name: value};
    ValueError, one line naming the file and the fix, for anything wrong."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML ({exc})") from None
    table = doc.get(command)
    if isinstance(table, dict):
        doc = table
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            continue  # another command's table
        name = keys.get(key) or keys.get(key.replace("_", "-"))
        if name is None:
            known = ", ".join(sorted(k for k in keys if "_" not in k))
            raise ValueError(f"--config {path}: unknown setting {key!r} for {command} "
                             f"(known: {known})")
        out[name] = value
    return out


def _load_config(ctx: typer.Context, value: str) -> str:
    """``--config FILE``: its settings become the defaults of this command's other flags, so a
    flag or an environment variable still wins (click: command line > env > default_map)."""
    if value:
        try:
            settings = read_config(Path(value), ctx.info_name or "", _config_keys(ctx))
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE)
        ctx.default_map = {**(ctx.default_map or {}), **settings}
    return value


ConfigOption = Annotated[str, typer.Option(
    "--config", is_eager=True, callback=_load_config, show_default=False,
    help="TOML file of settings, one key per flag (port = 12378); flags and SBPSTREAM_* "
    "variables win over it (docs/operations.md).")]
LogLevelOption = Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")]
LogFormatOption = Annotated[str, typer.Option(
    "--log-format", help="kv (key=value words) or json (one object per line).")]


_KV = re.compile(r"""(\w+)=("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\S+)""")


class KeyValueFormatter(logging.Formatter):
    """``ts=2026-01-02T03:04:05.678Z level=INFO logger=sbpstream.pm event=... ...``."""

    def format(self, record: logging.LogRecord) -> str:
        line = (f"ts={_utc(record.created)} level={record.levelname} logger={record.name} "
                f"{record.getMessage()}")
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, and each ``key=value``
    word of the message as its own field (quotes removed)."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        out: dict[str, Any] = {"ts": _utc(record.created), "level": record.levelname,
                               "logger": record.name, "msg": msg}
        for key, value in _KV.findall(msg):
            if key not in out:
                out[key] = value[1:-1] if value[:1] in "'\"" and value[-1:] == value[:1] else value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def _utc(created: float) -> str:
    """ISO 8601 in UTC with milliseconds: sorts as text, one word (no space)."""
    ms = int(created % 1 * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{ms:03d}Z"


def check_log_options(level: str, fmt: str) -> str | None:
    """The problem with ``--log-level``/``--log-format``, or None."""
    if fmt not in LOG_FORMATS:
        return f"--log-format {fmt!r}: expected {' or '.join(LOG_FORMATS)}"
    if not isinstance(logging.getLevelName(level.upper()), int):
        return f"--log-level {level!r}: expected DEBUG, INFO, WARNING or ERROR"
    return None


def setup_logging(level: str, fmt: str = "kv") -> None:
    """The one log set-up of every server: a stderr handler with the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())


def unblock_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP delivered again (a parent may have started us with them
    blocked, and a blocked mask survives exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)
