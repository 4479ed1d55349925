"""Generate :mod:`sbpstream.client.sync` from the async classes, by introspection.

The async client is written by hand; its sync twin is *derived*: for every public method of
:class:`AsyncClient`, :class:`AsyncAdmin`, :class:`AsyncProducer` and :class:`AsyncConsumer`
(and their public properties) this emits a typed sync method with the same signature and
docstring that runs the coroutine on the client's private loop thread. Results that are async
objects are wrapped (AsyncAdmin -> Admin, AsyncProducer -> Producer, AsyncConsumer -> Consumer,
asyncio futures -> concurrent futures).

Run ``python -m sbpstream.client._syncgen`` after changing a public async signature;
``tests/test_client_sync.py`` fails when the committed file differs from what this generates.
"""

from __future__ import annotations

import builtins
import collections.abc
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from sbpstream import records as sbp_records
from sbpstream.client import _sync_support
from sbpstream.client import options as client_options
from sbpstream.client import producer as client_producer
from sbpstream.client import types as client_types
from sbpstream.client.aclient import AsyncClient
from sbpstream.client.admin import AsyncAdmin
from sbpstream.client.consumer import AsyncConsumer
from sbpstream.client.producer import AsyncProducer

TARGET = Path(__file__).with_name("sync.py")
LINE_MAX = 100

# (async class, sync class name, sync base class)
SPECS: list[tuple[type, str, str]] = [
    (AsyncClient, "Client", "ClientBase"),
    (AsyncAdmin, "Admin", "AdminBase"),
    (AsyncProducer, "Producer", "ProducerBase"),
    (AsyncConsumer, "Consumer", "ConsumerBase"),
]
# return annotation -> (sync annotation, wrapper of the awaited/called expression)
RETURN_MAP: dict[str, tuple[str, str]] = {
    "AsyncAdmin": ("Admin", "Admin._wrap(self._runner, {})"),
    "AsyncProducer": ("Producer", "Producer._wrap(self._runner, {})"),
    "AsyncConsumer": ("Consumer", "Consumer._wrap(self._runner, {})"),
    "asyncio.Future[int]": ("concurrent.futures.Future[int]", "to_cf({})"),
    "list[asyncio.Future[int]]": ("list[concurrent.futures.Future[int]]", "to_cf_list({})"),
    # send_batch: one cross-thread future per call, whatever its record count
    "asyncio.Future[Offsets]": ("concurrent.futures.Future[Offsets]", "to_cf({})"),
}
# public async members with no sync twin, and why
ASYNC_ONLY: dict[str, str] = {
    "group_admin": "the group opcodes as awaitables, for async servers such as the Kafka "
                   "gateway; sync code uses the consumer's group methods",
    "connection": "a connection of the client's pool, used on its event loop by tools that "
                  "speak the protocol themselves",
    "high_watermark": "the plain reader's fetch state, for the Kafka gateway's FETCH answers",
    "batch_max_bytes": "the plain reader's per-FETCH limit, set by the Kafka gateway per request",
    "act_as": "a server acting for one caller with that caller's token (the Kafka gateway)",
    "pm_request": "protocol messages in and out, for tools running on an event loop (the "
                  "CLI's introspection); sync code uses the typed methods",
}
# names annotations may use, and where they come from
NAME_SOURCES = [collections.abc, typing, client_types, client_producer, client_options,
                sbp_records]


def public_members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined on ``cls``, in source order."""
    out = []
    for name, obj in vars(cls).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(obj) or isinstance(obj, property):
            out.append((name, obj))
    return out


def _default(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _params(fn: Any) -> tuple[list[str], list[str]]:
    """(parameter declarations, call arguments) of ``fn`` without ``self``."""
    decls: list[str] = []
    args: list[str] = []
    star_done = False
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        ann = f": {p.annotation}" if p.annotation is not inspect.Parameter.empty else ""
        default = "" if p.default is inspect.Parameter.empty else f" = {_default(p.default)}"
        if p.kind is p.VAR_POSITIONAL:
            decls.append(f"*{p.name}{ann}")
            args.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            decls.append(f"**{p.name}{ann}")
            args.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star_done:
                decls.append("*")
                star_done = True
            decls.append(f"{p.name}{ann}{default}")
            args.append(f"{p.name}={p.name}")
        else:
            decls.append(f"{p.name}{ann}{default}")
            args.append(p.name)
    return decls, args


def _def(name: str, decls: list[str], ret: str) -> list[str]:
    one = f"    def {name}(self{''.join(', ' + d for d in decls)}) -> {ret}:"
    if len(one) <= LINE_MAX:
        return [one]
    return [f"    def {name}(", "        self,", *[f"        {d}," for d in decls],
            f"    ) -> {ret}:"]


def _call(open_: str, args: list[str], close_: str) -> list[str]:
    one = f"        {open_}{', '.join(args)}{close_}"
    if len(one) <= LINE_MAX:
        return [one]
    return [f"        {open_}", *[f"            {a}," for a in args], f"        {close_}"]


def _doc(obj: Any) -> list[str]:
    doc = inspect.getdoc(obj)
    if not doc:
        return []
    body = textwrap.indent(doc.replace('"""', "'''"), "        ").splitlines()
    body[0] = body[0].lstrip()
    if len(body) == 1:
        return [f'        """{body[0]}"""']
    return [f'        """{body[0]}', *[ln.rstrip() for ln in body[1:]], '        """']


def _method(name: str, fn: Any, before: bool) -> list[str]:
    decls, args = _params(fn)
    ret_async = str(inspect.signature(fn).return_annotation)
    ret, wrap = RETURN_MAP.get(ret_async, (ret_async, "{}"))
    pre, post = wrap.split("{}")
    if inspect.iscoroutinefunction(fn):
        open_, close_ = f"self._runner.run({pre}self._async.{name}(", f"){post})"
    else:
        open_, close_ = f"{pre}self._runner.call(", f"){post}"
        args = [f"self._async.{name}", *args]
    body = _call(("return " if ret != "None" else "") + open_, args, close_)
    if before:
        body = ["        self._before_call()", *body]
    if name == "close" and ret == "None":
        body = ["        if self._runner.closed:", "            return", *body,
                "        self._after_close()"]
    return [*_def(name, decls, ret), *_doc(fn), *body]


def _property(name: str, prop: property) -> list[str]:
    ret_async = str(inspect.signature(prop.fget).return_annotation) if prop.fget else "Any"
    ret, wrap = RETURN_MAP.get(ret_async, (ret_async, "{}"))
    lines = ["    @property", f"    def {name}(self) -> {ret}:", *_doc(prop.fget)]
    return [*lines, "        return " + wrap.format(f"self._async.{name}")]


def _init(cls: type) -> list[str]:
    decls, args = _params(cls.__init__)  # type: ignore[misc]
    lines = _def("__init__", decls, "None") + _doc(cls)
    lines.append("        self._runner = LoopThread()")
    lines += _call("self._async = self._runner.call(", [cls.__name__, *args], ")")
    return lines


def render() -> str:
    classes: list[str] = []
    annotations: list[str] = []
    for cls, sync_name, base in SPECS:
        lines = [f"class {sync_name}({base}):"]
        first = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        text = f"Synchronous twin of :class:`{cls.__name__}` (blocking calls). {first}"
        wrapped = textwrap.wrap(text, LINE_MAX - 8)
        lines += [f'    """{wrapped[0]}', *[f"    {w}" for w in wrapped[1:]], '    """']
        lines.append("")
        if cls is AsyncClient:
            lines += _init(cls)
            lines.append("")
        else:
            lines += [
                "    @classmethod",
                f"    def _wrap(cls, runner: LoopThread, obj: {cls.__name__}) -> {sync_name}:",
                "        self = cls.__new__(cls)",
                "        self._runner = runner",
                "        self._async = obj",
                "        self._setup()",
                "        return self",
                "",
            ]
        base_cls = getattr(_sync_support, base)
        # a public method the base class defines is hand-written there: not generated; a base
        # that overrides _before_call has it called first by every generated method
        hand_written = {n for n in vars(base_cls) if not n.startswith("_")}
        before = "_before_call" in vars(base_cls)
        for name, member in public_members(cls):
            if name in hand_written or name in ASYNC_ONLY:
                continue
            if isinstance(member, property):
                lines += _property(name, member)
            else:
                lines += _method(name, member, before)
                sig = inspect.signature(member)
                annotations += [str(p.annotation) for p in sig.parameters.values()
                                if p.annotation is not inspect.Parameter.empty]
                annotations.append(str(sig.return_annotation))
            lines.append("")
        if cls is AsyncClient:
            annotations += [str(p.annotation) for p in inspect.signature(cls).parameters.values()
                            if p.annotation is not inspect.Parameter.empty]
        classes.append("\n".join(lines).rstrip() + "\n")
    header = _header(annotations)
    return header + "\n\n" + "\n\n".join(classes)


def _header(annotations: list[str]) -> str:
    names: set[str] = set()
    for ann in annotations:
        ann = RETURN_MAP.get(ann, (ann, ""))[0]
        names.update(re.findall(r"(?<![.\w])([A-Za-z_]\w*)(?![\w])", ann))
    imports: dict[str, set[str]] = {}
    for n in sorted(names):
        if hasattr(builtins, n) or n in {"Admin", "Producer", "Consumer", "Client", "concurrent",
                                         "AsyncAdmin", "AsyncProducer"}:
            continue
        for mod in NAME_SOURCES:
            if n in getattr(mod, "__all__", ()) or (mod is collections.abc and hasattr(mod, n)):
                imports.setdefault(mod.__name__, set()).add(n)
                break
        else:
            raise RuntimeError(f"cannot resolve annotation name {n!r}")
    std = ["import concurrent.futures"]
    std += [f"from {m} import {', '.join(sorted(ns))}" for m, ns in sorted(imports.items())
            if not m.startswith("sbpstream")]
    ours = [
        "from sbpstream.client._sync_support import (",
        "    AdminBase,",
        "    ClientBase,",
        "    ConsumerBase,",
        "    LoopThread,",
        "    ProducerBase,",
        "    to_cf,",
        "    to_cf_list,",
        ")",
    ]
    imports.setdefault("sbpstream.client.aclient", set()).add("AsyncClient")
    imports.setdefault("sbpstream.client.admin", set()).add("AsyncAdmin")
    imports.setdefault("sbpstream.client.consumer", set()).add("AsyncConsumer")
    imports.setdefault(client_producer.__name__, set()).add("AsyncProducer")
    for m, ns in sorted(imports.items()):
        if m.startswith("sbpstream"):
            one = f"from {m} import {', '.join(sorted(ns))}"
            ours += [one] if len(one) <= LINE_MAX else [
                f"from {m} import (", *[f"    {n}," for n in sorted(ns)], ")"]
    return "\n".join([
        '"""Synchronous SDK, GENERATED by ``python -m sbpstream.client._syncgen``: do not edit.',
        "",
        "Derived from the hand-written async classes: each sync method runs the coroutine of the",
        "same name on the client's private event loop thread and blocks until it is done.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        *std,
        "",
        *ours,
        "",
        '__all__ = ["Admin", "Client", "Consumer", "Producer"]',
        "",
    ])


def main() -> None:
    TARGET.write_text(render())
    print(f"wrote {TARGET}", file=sys.stderr)


if __name__ == "__main__":
    main()
