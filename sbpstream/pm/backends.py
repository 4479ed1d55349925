"""The metadata backends by ``--metadata`` URL: checking a URL and opening its store.

This is the one module that knows both backends, so nothing below it does: :mod:`.metadata`
(the interface) and :mod:`.rules` never import a backend, and :mod:`.config` checks a URL here
without importing the etcd package itself. Each backend is imported only when its URL is used
(the etcd one needs the optional aetcd dependency).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sbpstream.pm.metadata import MetadataStore

ETCD_SCHEME = "etcd://"


def is_etcd(url: str) -> bool:
    return url.startswith(ETCD_SCHEME)


def sqlite_path(metadata: str) -> Path:
    """The file of a ``sqlite:PATH`` metadata URL; ValueError for anything else."""
    scheme, sep, rest = metadata.partition(":")
    if scheme == "sqlite" and sep and rest:
        return Path(rest.removeprefix("//") if rest.startswith("///") else rest)
    raise ValueError(f"--metadata {metadata!r}: expected sqlite:PATH or etcd://HOST:PORT")


def validate_etcd_url(metadata: str) -> None:
    """ValueError for a malformed etcd URL, or when the etcd extra (aetcd) is not installed."""
    try:
        from sbpstream.pm.etcd import parse_etcd_url  # the optional etcd dependency
    except ImportError as e:
        raise ValueError(
            f"--metadata {metadata!r}: the etcd backend needs aetcd (pip install "
            f"'sbpstream[etcd]'): {e}"
        ) from e
    parse_etcd_url(metadata)


def check_metadata_url(url: str) -> None:
    """ValueError naming the fix for a URL no backend takes."""
    if is_etcd(url):
        validate_etcd_url(url)
    else:
        sqlite_path(url)


def open_metadata(url: str) -> MetadataStore:
    """The store a ``--metadata`` URL names, not yet opened (``await store.open()``):
    ``sqlite:PATH`` (the embedded default) or ``etcd://HOST:PORT[,...][/PREFIX][?...]`` (several
    PMs, one leader; needs the optional aetcd dependency). ValueError for anything else."""
    if is_etcd(url):
        from sbpstream.pm.etcd import EtcdMetadataStore

        return EtcdMetadataStore(url)
    from sbpstream.pm.sqlite_meta import SqliteMetadataStore

    return SqliteMetadataStore(sqlite_path(url))
