"""Schema versions: an append-only, ordered list of migrations.

A fresh database is created at the latest version straight from the models
and stamped with every version. An existing one runs the migrations above its
recorded version, in order, each in its own transaction. A database whose
version is above :data:`LATEST_VERSION` is refused: a newer chatkv wrote it.

Rules for adding one: never edit a published migration; write DDL that both
SQLite and PostgreSQL accept; define any table it creates inside the
migration (a frozen copy), not by importing the current model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import (
    Column,
    DateTime,
    MetaData,
    String,
    Table,
    Text,
    insert,
    inspect,
    select,
)
from sqlalchemy.engine import Connection, Engine

from .errors import SchemaVersionError, StorageError
from .schema import Base, SchemaVersionRow, utcnow


@dataclass(frozen=True)
class Migration:
    """One step from ``version - 1`` to ``version``."""

    version: int
    description: str
    apply: Callable[[Connection], None]


def _v1_initial(conn: Connection) -> None:
    # Never runs: every database starts at v1 or later (an empty one is created
    # at the latest version by upgrade()). Kept so the list reads as the history.
    raise SchemaVersionError("a database below schema v1 is not a chatkv index")


def _v2_leases_and_generation(conn: Connection) -> None:
    md = MetaData()
    Table(
        "chatkv_leases",
        md,
        Column("session_id", String(128), primary_key=True),
        Column("owner", String(255), nullable=False),
        Column("acquired_at", DateTime, nullable=False),
        Column("renewed_at", DateTime, nullable=False),
        Column("expires_at", DateTime, nullable=False),
    )
    md.create_all(conn)
    conn.exec_driver_sql(
        "ALTER TABLE chatkv_sessions ADD COLUMN kv_generation INTEGER NOT NULL DEFAULT 0"
    )


def _v3_message_flags(conn: Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE chatkv_messages ADD COLUMN flags INTEGER NOT NULL DEFAULT 0")


def _v4_provenance_and_debris(conn: Connection) -> None:
    md = MetaData()
    Table(
        "chatkv_pending_files",
        md,
        Column("token", String(32), primary_key=True),
        Column("chunk_hash", String(64), primary_key=True),
        Column("created_at", DateTime, nullable=False),
    )
    Table(
        "chatkv_meta",
        md,
        Column("key", String(64), primary_key=True),
        Column("value", Text, nullable=False),
        Column("updated_at", DateTime, nullable=False),
    )
    md.create_all(conn)
    # Rows indexed before v4 cannot be told apart: most came from save_kv, and
    # an import back then was trusted the same way, so they keep that trust.
    conn.exec_driver_sql("ALTER TABLE chatkv_chunks ADD COLUMN verified BOOLEAN NOT NULL DEFAULT TRUE")


def _v5_session_retention(conn: Connection) -> None:
    # Retention per conversation (issue 16): a pin and a TTL override. Plain
    # ADD COLUMN, which SQLite and PostgreSQL both accept; existing sessions
    # are unpinned and follow the store-wide TTL.
    conn.exec_driver_sql("ALTER TABLE chatkv_sessions ADD COLUMN pinned BOOLEAN NOT NULL DEFAULT FALSE")
    conn.exec_driver_sql("ALTER TABLE chatkv_sessions ADD COLUMN kv_ttl_s FLOAT")


def _v6_lease_generation(conn: Connection) -> None:
    # Fencing tokens (issue 12): every acquire of a lease bumps its generation,
    # and a holder's writes are conditional on the one it took. Rows from
    # before start at 0, so the next taker's is 1.
    conn.exec_driver_sql("ALTER TABLE chatkv_leases ADD COLUMN generation INTEGER NOT NULL DEFAULT 0")


def _v7_wide_byte_counts(conn: Connection) -> None:
    # Byte counts as 64-bit integers: one session's KV passes 2 GiB (a 7B model
    # in fp16 at about 4k tokens) and PostgreSQL's INTEGER is 32-bit. SQLite's
    # INTEGER is 64-bit already; other backends keep what they have.
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("ALTER TABLE chatkv_sessions ALTER COLUMN kv_bytes TYPE BIGINT")
        conn.exec_driver_sql("ALTER TABLE chatkv_chunks ALTER COLUMN bytes TYPE BIGINT")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "sessions, messages, chunks, session_chunks", _v1_initial),
    Migration(2, "leases table; sessions.kv_generation", _v2_leases_and_generation),
    Migration(3, "messages.flags (bit 0: a reply cut short)", _v3_message_flags),
    Migration(4, "chunks.verified; pending files (crash debris); meta (lost index)", _v4_provenance_and_debris),
    Migration(5, "sessions.pinned, sessions.kv_ttl_s (retention per conversation)", _v5_session_retention),
    Migration(6, "leases.generation (the fencing token)", _v6_lease_generation),
    Migration(7, "sessions.kv_bytes, chunks.bytes: 64-bit on PostgreSQL", _v7_wide_byte_counts),
)
LATEST_VERSION = MIGRATIONS[-1].version
#: The oldest schema a read-only Store (which cannot migrate) still lists and shows.
READ_ONLY_MIN_VERSION = 3


def current_version(conn: Connection) -> int | None:
    """The schema version recorded in the database, or ``None`` if it has no chatkv tables.

    Raises:
        SchemaVersionError: chatkv tables exist but no version table (unknown origin).
    """
    names = set(inspect(conn).get_table_names())
    if SchemaVersionRow.__tablename__ not in names:
        if any(n.startswith("chatkv_") for n in names):
            raise SchemaVersionError(
                "the index has chatkv tables but no chatkv_schema table; refusing to guess its version"
            )
        return None
    v = conn.execute(select(SchemaVersionRow.version).order_by(SchemaVersionRow.version.desc())).first()
    return int(v[0]) if v else None


def upgrade(engine: Engine) -> int:
    """Bring the database at ``engine`` to :data:`LATEST_VERSION`; return the version before.

    Side effects: creates all tables on an empty database; runs pending
    migrations, each in its own transaction, recording each in ``chatkv_schema``.

    Raises:
        SchemaVersionError: the database is newer than this chatkv, or not a chatkv index.
    """
    with engine.begin() as conn:
        before = current_version(conn)
        if before is None:
            Base.metadata.create_all(conn)
            for m in MIGRATIONS:
                conn.execute(
                    insert(SchemaVersionRow).values(
                        version=m.version, description=m.description, applied_at=utcnow()
                    )
                )
            return 0
    if before > LATEST_VERSION:
        raise SchemaVersionError(
            f"the index at {engine.url.render_as_string(hide_password=True)} has schema version "
            f"{before}, newer than this chatkv understands ({LATEST_VERSION}); upgrade chatkv"
        )
    for m in MIGRATIONS:
        if m.version <= before:
            continue
        with engine.begin() as conn:
            # Re-read under the write lock: another process may have migrated meanwhile.
            if (current_version(conn) or 0) >= m.version:
                continue
            m.apply(conn)
            conn.execute(
                insert(SchemaVersionRow).values(
                    version=m.version, description=m.description, applied_at=utcnow()
                )
            )
    return before


def readable_version(engine: Engine) -> int:
    """The schema version of an index opened read-only (nothing is created or migrated).

    A version from :data:`READ_ONLY_MIN_VERSION` up is returned as is; the
    Store reads it as far as it can (listing and showing sessions).

    Raises:
        StorageError: the database has no chatkv tables.
        SchemaVersionError: it is newer than this chatkv, or not a chatkv index.
    """
    with engine.connect() as conn:
        version = current_version(conn)
    where = engine.url.render_as_string(hide_password=True)
    if version is None:
        raise StorageError(f"the index at {where} has no chatkv tables (and cannot be created read-only)")
    if version < READ_ONLY_MIN_VERSION:
        raise StorageError(f"the index at {where} has schema version {version}, too old to read without "
                           "migrating it; open it once where it is writable")
    if version > LATEST_VERSION:
        raise SchemaVersionError(f"the index at {where} has schema version {version}, newer than "
                                 f"this chatkv understands ({LATEST_VERSION}); upgrade chatkv")
    return version
