"""The SQLite metadata file's schema: its tables, its version and the migrations that bring an
older file up to it (:func:`init_schema`, run at open). The rows' encoding is in
:mod:`sbpstream.pm.sqlite_rows`; the store in :mod:`sbpstream.pm.sqlite_meta`."""

from __future__ import annotations

import logging
import sqlite3
from typing import Final

from sbpstream.pm.metadata import FIRST_NODE_ID, FIRST_STREAM_ID
from sbpstream.pm.rules import COUNTER_NODE, COUNTER_STREAM
from sbpstream.protocol.errors import MetadataError

log = logging.getLogger("sbpstream.pm.sqlite")

SCHEMA_VERSION: Final = 4
"""Bumped by every schema change; ``_MIGRATIONS[v]`` upgrades a file from version ``v``."""

NAMES_TABLE: Final = """CREATE TABLE IF NOT EXISTS stream_names (
        name TEXT PRIMARY KEY,
        stream_id INTEGER NOT NULL
    ) WITHOUT ROWID"""
"""The name index is its own table: its primary key keeps live names unique; a deleted
stream's row here goes while the stream row keeps its name for history."""

OFFSETS_TABLE: Final = """CREATE TABLE IF NOT EXISTS consumer_offsets (
        group_name TEXT NOT NULL,
        stream_id INTEGER NOT NULL,
        committed INTEGER NOT NULL,
        metadata TEXT NOT NULL DEFAULT '',
        commit_ms INTEGER NOT NULL,
        PRIMARY KEY (group_name, stream_id)
    ) WITHOUT ROWID"""
"""Committed offsets of consumer groups (issue 21): one row per (group, stream)."""

NAMES_BY_STREAM: Final = (
    "CREATE INDEX IF NOT EXISTS stream_names_by_stream ON stream_names (stream_id)")

SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS meta (
        key TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS streams (
        stream_id INTEGER PRIMARY KEY,
        replica_nums INTEGER NOT NULL,
        retention_period_ms INTEGER NOT NULL,
        start_offset INTEGER NOT NULL DEFAULT 0,
        deleted INTEGER NOT NULL DEFAULT 0,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL,
        name TEXT NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE IF NOT EXISTS ranges (
        stream_id INTEGER NOT NULL,
        range_index INTEGER NOT NULL,
        start_offset INTEGER NOT NULL,
        end_offset INTEGER NOT NULL,
        next_offset INTEGER NOT NULL,
        PRIMARY KEY (stream_id, range_index)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS range_replicas (
        stream_id INTEGER NOT NULL,
        range_index INTEGER NOT NULL,
        node_id INTEGER NOT NULL,
        is_primary INTEGER NOT NULL,
        PRIMARY KEY (stream_id, range_index, node_id)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS range_replicas_by_node ON range_replicas (node_id)",
    """CREATE TABLE IF NOT EXISTS data_nodes (
        node_id INTEGER PRIMARY KEY,
        host TEXT NOT NULL,
        advertise_addr TEXT NOT NULL,
        registered_ms INTEGER NOT NULL,
        last_heartbeat_ms INTEGER NOT NULL DEFAULT 0,
        metrics TEXT,
        metrics_ms INTEGER NOT NULL DEFAULT 0,
        draining INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE IF NOT EXISTS seal_producers (
        stream_id INTEGER NOT NULL,
        range_index INTEGER NOT NULL,
        producer_id INTEGER NOT NULL,
        producer_epoch INTEGER NOT NULL,
        last_sequence INTEGER NOT NULL,
        last_base_offset INTEGER NOT NULL,
        PRIMARY KEY (stream_id, range_index, producer_id)
    ) WITHOUT ROWID""",
    NAMES_TABLE,
    NAMES_BY_STREAM,
    OFFSETS_TABLE,
)

QUOTAS_TABLE: Final = (
    """CREATE TABLE IF NOT EXISTS quotas (
        key TEXT PRIMARY KEY,
        kind INTEGER NOT NULL,
        name TEXT NOT NULL,
        produce_bytes_per_s INTEGER NOT NULL,
        fetch_bytes_per_s INTEGER NOT NULL,
        requests_per_s INTEGER NOT NULL,
        principal TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID"""
)
"""Quotas (issue 22). Created at every open when missing, without a schema version bump: an
older sbpstream opening the file ignores the table (it enforces no quotas). ``principal`` (user
and user+client-id quotas) came later: a table from before it gets the column at open (ADD
COLUMN with a default; an older sbpstream reads the table as before and ignores the column)."""

AUTH_TABLE: Final = """CREATE TABLE IF NOT EXISTS auth_records (
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (kind, key)
    ) WITHOUT ROWID"""
"""Users and ACL rules (sbpstream.auth.records): opaque values by kind and key."""


MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {
    1: ("ALTER TABLE streams ADD COLUMN name TEXT NOT NULL DEFAULT ''", NAMES_TABLE,
        NAMES_BY_STREAM),  # named streams (issue 20): old files have none
    2: (OFFSETS_TABLE,),  # consumer groups' committed offsets (issue 21)
    3: ("ALTER TABLE data_nodes ADD COLUMN draining INTEGER NOT NULL DEFAULT 0",),  # drains
}
"""from-version -> statements bringing the file to from-version + 1."""


def init_schema(c: sqlite3.Connection, path: str) -> None:
    """Create the tables of a new file, or migrate an older one to :data:`SCHEMA_VERSION`
    (inside the caller's transaction). MetadataError for a file newer than this code."""
    c.execute(SCHEMA[0])
    c.execute(QUOTAS_TABLE)  # not versioned: see QUOTAS_TABLE
    cols = {str(r[1]) for r in c.execute("PRAGMA table_info(quotas)")}
    if "principal" not in cols:
        c.execute("ALTER TABLE quotas ADD COLUMN principal TEXT NOT NULL DEFAULT ''")
    row = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        for stmt in SCHEMA[1:]:
            c.execute(stmt)
        c.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [
                ("schema_version", SCHEMA_VERSION),
                (COUNTER_STREAM, FIRST_STREAM_ID),
                (COUNTER_NODE, FIRST_NODE_ID),
            ],
        )
        log.info("event=metadata_created path=%s schema_version=%d", path,
                 SCHEMA_VERSION)
        return
    version = int(row[0])
    if version > SCHEMA_VERSION:
        raise MetadataError(
            f"metadata file {path} has schema version {version}, newer than this "
            f"sbpstream ({SCHEMA_VERSION}); upgrade sbpstream"
        )
    while version < SCHEMA_VERSION:
        for stmt in MIGRATIONS[version]:
            if not _column_present(c, stmt):
                c.execute(stmt)
        version += 1
        c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
        log.info("event=metadata_migrated path=%s schema_version=%d", path, version)


def _column_present(c: sqlite3.Connection, stmt: str) -> bool:
    """True for an ``ALTER TABLE t ADD COLUMN col ...`` whose column ``t`` already has (a file
    rebuilt by hand, or a migration interrupted outside its transaction): adding it again would
    fail, and there is nothing to add."""
    words = stmt.split()
    if len(words) < 6 or [w.upper() for w in (words[0], words[1], words[3], words[4])] != [
            "ALTER", "TABLE", "ADD", "COLUMN"]:
        return False
    cols = {str(r[1]) for r in c.execute(f"PRAGMA table_info({words[2]})")}
    return words[5] in cols
