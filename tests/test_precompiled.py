"""The message code is compiled ahead of time: ``sbpstream/protocol/_precompiled.py`` is what
``python -m sbpstream.protocol.codegen`` writes from the schema and the message classes, importing
the messages compiles nothing, and a source the module lacks is still compiled correctly."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from sbpstream.protocol import codegen, fbtable
from sbpstream.protocol import messages as m


@pytest.mark.integration  # it starts an interpreter (the generator's): the code is pure
def test_the_committed_module_is_current() -> None:
    assert codegen.TARGET.read_text() == codegen.render(), (
        "sbpstream/protocol/_precompiled.py is stale: run python -m sbpstream.protocol.codegen"
    )


PROBE = """
import dataclasses, inspect, json, pkgutil, sys  # the stdlib's own (namedtuples) come first
compiled = []
sys.addaudithook(lambda event, args: compiled.append(str(args[1])) if event == "compile"
                 and not str(args[1]).endswith(".py") else None)  # not a module's source
import sbpstream.protocol.messages
from sbpstream.protocol import fbtable
print(json.dumps({"runtime": fbtable.RUNTIME_COMPILED, "compiled": compiled}))
"""


@pytest.mark.integration  # a fresh interpreter
def test_importing_the_messages_compiles_nothing() -> None:
    """No exec, eval or compile of a string (dataclasses makes six per class): the audit hook
    sees every one."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"runtime": [], "compiled": []}


def test_a_source_without_precompiled_code_is_compiled() -> None:
    """The fallback: a class the module does not know (its field names are new) still gets
    working methods and codec, and is listed in RUNTIME_COMPILED."""
    schema = fbtable.parse_schema("table Fresh { brand_new: int = 7; other: string; }")
    codec = fbtable.Codec(schema)

    class Fresh(fbtable.Table):
        brand_new: int = 7
        other: str = ""

    cls = fbtable.frozen_dataclass(Fresh)
    codec.bind(cls)
    assert "dataclass Fresh" in fbtable.RUNTIME_COMPILED
    assert "codec Fresh" in fbtable.RUNTIME_COMPILED
    value = cls(3, "x")
    assert cls.decode(value.encode()) == value
    assert repr(value).endswith(".Fresh(brand_new=3, other='x')")


@pytest.mark.parametrize("value", [
    m.Range(1, 2, 3, 4, -1, (m.ReplicaNode(m.DataNode(5, "h:1"), True),)),
    m.Status(3, "no", b"x"), m.PingRequest(), m.Stream(name="s"),
])  # fmt: skip
def test_precompiled_dataclass_methods_behave_as_dataclasses(value: fbtable.Table) -> None:
    cls = type(value)
    fields = [f.name for f in dataclasses.fields(value)]  # type: ignore[arg-type]
    same = cls(*(getattr(value, f) for f in fields))
    assert same == value and hash(same) == hash(value) and same is not value
    assert value != object() and (not fields or value != cls())
    assert repr(value).startswith(f"{cls.__name__}(") and dataclasses.is_dataclass(value)
    assert pickle.loads(pickle.dumps(value)) == value
    assert cls.__match_args__ == tuple(fields)
    for name in fields[:1]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(value, name)
        assert dataclasses.replace(value, **{name: getattr(value, name)}) == value
    with pytest.raises(AttributeError):
        value.not_a_field = 1  # type: ignore[attr-defined]
