"""docs/spark.md's promise: after `make install`, a SparkSession from the venv finds the source.

The session runs in a child process with a clean environment (no PYTHONPATH, no PYSPARK_PYTHON,
another working directory), as a user's script would: nothing registers the source by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from sbpstream.client import Client
from sbpstream.cluster import LocalCluster
from sbpstream.spark import PLUGIN_PTH

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent("""
    import sys
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[1]")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    df = (spark.read.format("sbpstream").option("pm", sys.argv[1])
          .option("streams", sys.argv[2]).load())
    print("COUNT", df.count())
    spark.stop()
""")


def test_format_sbpstream_works_without_register(tmp_path: Path) -> None:
    if shutil.which("java") is None:
        pytest.skip("java is not on PATH")
    pytest.importorskip("pyspark")
    pth = Path(sysconfig.get_paths()["purelib"]) / PLUGIN_PTH
    if not pth.exists() and "__editable__" in "".join(os.listdir(pth.parent)):
        pytest.fail(f"editable install without {pth}: run `make install`")
    with LocalCluster(tmp_path / "c", datanodes=1) as cluster:
        with Client(cluster.pm_address) as c:
            sid = c.create_stream()
            with c.producer() as p:
                for i in range(3):
                    p.send(sid, b"v%d" % i)
        script = tmp_path / "user_script.py"
        script.write_text(SCRIPT)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
        r = subprocess.run([sys.executable, str(script), cluster.pm_address, str(sid)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200,
                           check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "COUNT 3" in r.stdout, r.stdout
