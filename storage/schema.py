"""The index's tables, as SQLAlchemy 2.x declarative models (latest schema version).

Table names carry a ``chatkv_`` prefix so the index can share a PostgreSQL
database with an application. Times are UTC. Token ids are int32
little-endian blobs (:func:`~.hashing.pack_token_ids`).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores naive UTC, returns aware UTC, on every backend."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.replace(tzinfo=timezone.utc) if value is not None else None


class Base(DeclarativeBase):
    """Declarative base of the index models."""


class SchemaVersionRow(Base):
    """One row per applied migration; the highest version is the schema's."""

    __tablename__ = "chatkv_schema"
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    description: Mapped[str] = mapped_column(String(200))
    applied_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class SessionRow(Base):
    """A conversation: its facts and what its KV cache covers."""

    __tablename__ = "chatkv_sessions"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    fingerprint: Mapped[str | None] = mapped_column(String(200), nullable=True)
    system_prompt: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # KV covers exactly cached_ids (n_cached of them) under `fingerprint`.
    n_cached: Mapped[int] = mapped_column(Integer, default=0)
    cached_ids: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    #: v7: 64-bit (a session's KV may pass 2 GiB).
    kv_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    tier: Mapped[str] = mapped_column(String(32), default="none")
    # v2: bumped by every KV commit, so a reader can tell states apart.
    kv_generation: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # v5: retention per conversation. Deferred, so a read-only Store on an older
    # index (which lacks them) can still load rows; reads go through
    # _INFO_COLUMNS, which checks the schema version.
    #: Keep this session's KV resident however long it idles; gc expires it by TTL never
    #: and drops it for the disk budget only after every unpinned session.
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false(), deferred=True)
    #: Idle seconds after which this session's KV expires, overriding the store-wide TTL (None: the store's).
    kv_ttl_s: Mapped[float | None] = mapped_column(Float, nullable=True, deferred=True)


MESSAGE_PARTIAL = 1
#: The message is outside the model's window (left out by a trimming context policy).
MESSAGE_OUTSIDE_WINDOW = 2


class MessageRow(Base):
    """One message of a session's history (the source of truth)."""

    __tablename__ = "chatkv_messages"
    __table_args__ = (UniqueConstraint("session_id", "idx", name="uq_chatkv_messages_session_idx"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("chatkv_sessions.id", ondelete="CASCADE"), index=True
    )
    idx: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(32))
    content: Mapped[str] = mapped_column(Text)
    tok_start: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tok_end: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: Bit field; :data:`MESSAGE_PARTIAL` marks a reply cut short (Ctrl-C),
    #: :data:`MESSAGE_OUTSIDE_WINDOW` a message the model's window no longer holds.
    flags: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ChunkRow(Base):
    """A content-addressed chunk file. References are counted from ``chatkv_session_chunks``."""

    __tablename__ = "chatkv_chunks"
    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    parent: Mapped[str | None] = mapped_column(String(64), nullable=True)
    relpath: Mapped[str] = mapped_column(String(255))
    n_tokens: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)  # v7: 64-bit
    fingerprint: Mapped[str] = mapped_column(String(200))
    kv_format: Mapped[str] = mapped_column(String(64))
    quant: Mapped[str] = mapped_column(String(64))
    dtype: Mapped[str] = mapped_column(String(32))
    block_size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: v4: the tensors were written by the model's own engine (``save_kv``) or
    #: checked against it (``Store.mark_kv_verified``); false for imported KV.
    verified: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class SessionChunkRow(Base):
    """Position ``position`` of a session's ordered chunk list."""

    __tablename__ = "chatkv_session_chunks"
    __table_args__ = (Index("ix_chatkv_session_chunks_chunk", "chunk_hash"),)
    session_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("chatkv_sessions.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    chunk_hash: Mapped[str] = mapped_column(String(64), ForeignKey("chatkv_chunks.hash"))


class LeaseRow(Base):
    """v2: who is using a session now, until when. No FK: a lease may precede the session row.

    A released lease keeps its row (expiring at the epoch), so generations keep growing."""

    __tablename__ = "chatkv_leases"
    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    owner: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: v6: the fencing token. Bumped by every acquire (a takeover included); a
    #: holder's writes are conditional on the generation it took (:mod:`.leases`).
    generation: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class PendingFileRow(Base):
    """v4: a chunk file a Store may leave on disk without an index row, until it commits or unlinks.

    Recorded before the file is written (or in the commit that drops the
    chunk's row), deleted once the file is indexed or gone. When the Store
    named by ``token`` is provably gone (:mod:`.owners`), its rows say which
    orphan files it left, so they are removed at once.
    """

    __tablename__ = "chatkv_pending_files"
    token: Mapped[str] = mapped_column(String(32), primary_key=True)
    chunk_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MetaRow(Base):
    """v4: facts about the index itself, by key (e.g. :data:`META_INDEX_LOST`)."""

    __tablename__ = "chatkv_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


#: Set when this index was created over a home that already held chunk files
#: (the previous index was deleted or emptied): gc keeps orphans until cleared.
META_INDEX_LOST = "index_lost"
