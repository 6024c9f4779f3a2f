"""Plain records the store returns and takes; no ORM objects leak out of ``Store``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from .chunkfile import ChunkMeta
from .hashing import ChunkHash

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SessionInfo:
    """Facts about one session, as ``sessions ls`` shows them."""

    id: str
    fingerprint: str | None
    system_prompt: str | None
    created_at: datetime
    updated_at: datetime
    last_used_at: datetime
    n_cached: int
    n_messages: int
    n_turns: int
    n_chunks: int
    kv_bytes: int
    tier: str
    kv_generation: int
    #: False while any of its KV chunks came from an import and has not been
    #: checked against the model (:meth:`Store.mark_kv_verified`); a caller
    #: must verify or drop such KV before using it. True when there is no KV.
    kv_verified: bool = True
    #: v5: keep its KV resident however long it idles (``chatkv sessions pin``, ``Chat(pin=True)``).
    pinned: bool = False
    #: v5: idle seconds after which its KV expires, overriding the store-wide TTL; None: the store's.
    kv_ttl_s: float | None = None


@dataclass(frozen=True)
class MessageRecord:
    """One message; ``token_span`` is ``(start, end)`` in the session's token ids, if known."""

    index: int
    role: str
    content: str
    token_span: tuple[int, int] | None
    created_at: datetime
    partial: bool = False
    outside_window: bool = False


@dataclass(frozen=True)
class NewMessage:
    """A message to store as part of :meth:`Store.create_session`; its index is its position.

    ``created_at`` defaults to the time of the commit.
    """

    role: str
    content: str
    token_span: tuple[int, int] | None = None
    partial: bool = False
    created_at: datetime | None = None
    outside_window: bool = False


@dataclass(frozen=True)
class ChunkInfo:
    """An indexed (or just written) chunk file. ``written`` is bytes this call wrote (0 on dedup)."""

    hash: ChunkHash
    parent: ChunkHash | None
    relpath: str
    n_tokens: int
    bytes: int
    fingerprint: str
    kv_format: str
    quant: str
    dtype: str
    block_size: int
    written: int = 0
    #: The tensors came from the model's engine (``save_kv``) or were checked
    #: against it; False for a chunk only an import vouches for.
    verified: bool = True


@dataclass(frozen=True)
class ChunkUsage:
    """One indexed chunk and how many session links point at it (0: unreferenced)."""

    hash: ChunkHash
    relpath: str
    bytes: int
    n_refs: int


@dataclass(frozen=True)
class NewChunk:
    """A chunk to write as part of :meth:`Store.save_kv`; its tokens come from the call's token ids."""

    n_tokens: int
    tensors: Mapping[str, torch.Tensor]
    meta: ChunkMeta


@dataclass(frozen=True)
class SaveResult:
    """What one :meth:`Store.save_kv` did."""

    session_id: str
    kv_generation: int
    n_cached: int
    chunks: list[ChunkInfo]
    bytes_written: int
    files_written: int
    files_removed: int
    bytes_removed: int


@dataclass(frozen=True)
class LoadedChunk:
    """One verified chunk of a session: its index facts, tokens and tensors."""

    info: ChunkInfo
    token_ids: list[int]
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class SessionKV:
    """A session's whole cached KV, in order; it covers exactly ``token_ids``."""

    session_id: str
    fingerprint: str | None
    token_ids: list[int]
    chunks: list[LoadedChunk]


@dataclass(frozen=True)
class RemoveResult:
    """Files and bytes a delete or invalidate removed from disk."""

    files_removed: int
    bytes_removed: int


@dataclass(frozen=True)
class SessionBytes:
    """Disk bytes of a session's KV: ``total`` counts shared chunks, ``unique`` only its own."""

    total: int
    unique: int
    shared: int


@dataclass(frozen=True)
class DiskUsage:
    """Home-wide accounting: the index's view and the file system's."""

    n_chunks: int
    indexed_bytes: int
    n_files: int
    file_bytes: int
    quarantine_files: int
    quarantine_bytes: int


@dataclass
class DebrisReport:
    """Leftovers of Stores that are provably gone, removed at once (see :meth:`Store.remove_debris`).

    ``owners`` are the gone Stores' tokens; ``temp_files`` their temp files;
    ``chunk_files`` chunk files they wrote or dropped and never indexed or unlinked.
    """

    owners: list[str] = field(default_factory=list)
    temp_files: list[Path] = field(default_factory=list)
    chunk_files: list[Path] = field(default_factory=list)
    bytes_removed: int = 0

    @property
    def files_removed(self) -> int:
        return len(self.temp_files) + len(self.chunk_files)


@dataclass
class GcReport:
    """What :func:`~chatkv.storage.gc.collect_garbage` found, and (unless ``dry_run``) removed.

    ``index_lost`` is a message when the index looks lost (see
    :meth:`Store.index_lost`); then ``orphans_kept`` is true unless gc was
    forced: the orphan files are listed but not removed.
    """

    dry_run: bool
    index_lost: str | None = None
    orphans_kept: bool = False
    debris: DebrisReport = field(default_factory=DebrisReport)
    orphan_files: list[Path] = field(default_factory=list)
    temp_files: list[Path] = field(default_factory=list)
    dangling_chunks: list[ChunkHash] = field(default_factory=list)
    unreferenced_chunks: list[ChunkHash] = field(default_factory=list)
    reclaimable_bytes: int = 0
    files_removed: int = 0
    bytes_reclaimed: int = 0
