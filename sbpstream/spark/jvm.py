"""The JVM batch reader ``format("sbpstream-jvm")``: where its jar is, and how it is built.

The Java sources live in ``sbpstream/spark/java/src/main/{java,resources}``. :func:`jar_path`
returns ``sbpstream/spark/build/sbpstream-spark-jvm.jar`` (gitignored), building it first when it
is missing or stale: ``javac --release 17`` against PySpark's own jars (Spark, the FlatBuffers,
zstd and lz4 runtimes, Jackson; nothing is downloaded), then ``jar``. Stale means the SHA-256 of
the sources, stored beside the jar, differs. ``python -m sbpstream.spark.jvm`` builds it
explicitly (``make install`` does). Put it on a session's classpath with
``.config("spark.jars", str(jar_path()))`` (docs/spark.md).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

FORMAT_NAME: Final = "sbpstream-jvm"
JAR_NAME: Final = "sbpstream-spark-jvm.jar"
JAVA_RELEASE: Final = "17"
BUILD_TIMEOUT_S: Final = 600.0  # javac of a few thousand lines, on a loaded 2-core machine

PACKAGE_DIR: Final = Path(__file__).resolve().parent
SOURCE_DIR: Final = PACKAGE_DIR / "java" / "src" / "main"
BUILD_DIR: Final = PACKAGE_DIR / "build"


class JvmBuildError(RuntimeError):
    """The jar could not be built (no JDK, no PySpark, or javac refused the sources)."""


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.rglob("*") if p.is_file())


def source_hash() -> str:
    """SHA-256 over the Java sources and resources (paths and contents) and the Java release."""
    h = hashlib.sha256(f"release={JAVA_RELEASE}\n".encode())
    for p in _sources():
        h.update(str(p.relative_to(SOURCE_DIR)).encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def pyspark_jars() -> Path:
    """PySpark's directory of jars (the compile classpath)."""
    try:
        import pyspark
    except ImportError as e:
        raise JvmBuildError(f"the sbpstream-jvm jar needs pyspark to build: {e}") from None
    jars = Path(pyspark.__file__).resolve().parent / "jars"
    if not jars.is_dir():
        raise JvmBuildError(f"pyspark has no jars directory at {jars}")
    return jars


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        home = os.environ.get("JAVA_HOME")
        cand = Path(home) / "bin" / name if home else None
        if cand is not None and cand.is_file():
            return str(cand)
        raise JvmBuildError(f"'{name}' not found: building the sbpstream-jvm jar needs a JDK 17+ "
                            "(apt-get install default-jdk-headless, or make install)")
    return found


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise JvmBuildError(f"{cmd[0]} took over {BUILD_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise JvmBuildError(f"{Path(cmd[0]).name} failed ({done.returncode}):\n"
                            f"{done.stdout}{done.stderr}")


def build(out_dir: Path = BUILD_DIR) -> Path:
    """Compile the sources and package the jar (always); returns its path."""
    javac, jar = _tool("javac"), _tool("jar")
    java_files = [str(p) for p in _sources() if p.suffix == ".java"]
    digest = source_hash()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        classes = Path(tmp) / "classes"
        classes.mkdir()
        _run([javac, "--release", JAVA_RELEASE, "-nowarn", "-encoding", "UTF-8",
              "-cp", str(pyspark_jars() / "*"), "-d", str(classes), *java_files])
        resources = SOURCE_DIR / "resources"
        if resources.is_dir():
            shutil.copytree(resources, classes, dirs_exist_ok=True)
        staged = Path(tmp) / JAR_NAME
        _run([jar, "--create", "--file", str(staged), "-C", str(classes), "."])
        target = out_dir / JAR_NAME
        os.replace(staged, target)  # atomic: a concurrent reader sees the old or the new jar
    (out_dir / (JAR_NAME + ".sha256")).write_text(digest + "\n")
    return target


def is_stale(out_dir: Path = BUILD_DIR) -> bool:
    target = out_dir / JAR_NAME
    stamp = out_dir / (JAR_NAME + ".sha256")
    if not target.is_file() or not stamp.is_file():
        return True
    return stamp.read_text().strip() != source_hash()


def jar_path() -> Path:
    """The reader's jar, built first when missing or stale (JvmBuildError when it cannot be)."""
    if is_stale():
        return build()
    return BUILD_DIR / JAR_NAME


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print("python -m sbpstream.spark.jvm [--if-stale]: build the sbpstream-jvm reader jar")
        return 0
    try:
        path = jar_path() if "--if-stale" in args else build()
    except JvmBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
