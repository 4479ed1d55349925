"""The protocol layer starts fast: importing it does not load numpy (flatbuffers would, for
helpers the codec never calls; see ``fbbuilder._import_flatbuffers``), leaves the import system as
it found it, and numpy still imports normally afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib.machinery, json, sys
before = vars(importlib.machinery.PathFinder)["find_spec"]
import sbpstream.protocol.messages as m
loaded = "numpy" in sys.modules
restored = vars(importlib.machinery.PathFinder)["find_spec"] is before
import numpy
print(json.dumps({"numpy_loaded_by_protocol": loaded, "finder_restored": restored,
                  "numpy_works": int(numpy.arange(4).sum()) == 6}))
"""


def test_importing_the_protocol_layer_does_not_load_numpy() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"numpy_loaded_by_protocol": False, "finder_restored": True,
                   "numpy_works": True}
