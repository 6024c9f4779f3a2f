"""Moving a session's KV between the block pool and disk chunks.

A session's computed tokens are cut into chunks of ``chunk_tokens`` (a multiple
of the block size) plus a partial tail. Each chunk is one content-addressed
safetensors file holding ``kv``: ``[num_layers, 2, n_tokens, kv_heads,
head_dim]`` in the model's dtype, token-major so files do not depend on the
pool's block size. Chunk hashes chain over the parent hash, the token ids, the
model fingerprint and the KV format, so a system prompt shared by many sessions
is one file, and a new turn writes only the chunks it completed plus its tail.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING


from chatkv.errors import OutOfBlocksError
from chatkv.models import KV_FORMAT_VERSION
from chatkv.storage import (
    ChunkInfo,
    ChunkMeta,
    CorruptChunkError,
    NewChunk,
    SaveResult,
    Store,
    default_db_url,
    default_home,
)

if TYPE_CHECKING:
    from chatkv.engine import Engine
    from chatkv.sequence import Sequence

KV_TENSOR = "kv"
DENSE_FORMAT = f"{KV_FORMAT_VERSION}:dense"
#: Full-precision layout, but KV computed from (or restored out of) a quantized
#: tier: a distinct format, so its chunk hashes never collide with exact ones.
LOSSY_FORMAT = f"{KV_FORMAT_VERSION}:dense-lossy"

_STORES: dict[tuple[str, str], Store] = {}
_STORES_LOCK = threading.Lock()


def default_store() -> Store:
    """The process-wide :class:`~chatkv.storage.Store` for the current
    ``CHATKV_HOME``/``CHATKV_DB_URL`` (opened on first use, then shared, so
    every ``Chat`` in the process holds leases under one owner)."""
    home = default_home()
    url = default_db_url(home)
    key = (str(Path(home).resolve()), url)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = Store(home, url)
            _STORES[key] = store
        return store


@dataclass
class SavedKV:
    """What the last successful save wrote: the token ids and their chunk list."""

    token_ids: list[int] = field(default_factory=list)
    chunks: list[ChunkInfo] = field(default_factory=list)


@dataclass
class RestoreInfo:
    """How a session came back.

    Attributes:
        source: ``"new"`` (no such session), ``"memory"`` (already resident in
            this process), ``"disk"`` (KV loaded from chunk files; a prefix may
            have come from blocks other sessions share), or ``"history"``
            (messages restored but the KV was unusable or absent: the next turn
            re-prefills).
        turns: user turns in the restored history.
        cached_tokens: tokens whose KV is resident after the restore.
        seconds: wall time of the restore.
        bytes_read: bytes of chunk files read.
        warning: why the KV was (partly) not used, if it was not.
    """

    source: str
    turns: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    warning: str | None = None


class KVPersister:
    """Saves a sequence's KV as chunks and restores it into the engine's pool."""

    def __init__(self, engine: "Engine", store: Store, chunk_tokens: int) -> None:
        """Persist ``engine``'s sequences into ``store`` in chunks of ``chunk_tokens``."""
        bs = engine.pool.block_size
        if chunk_tokens % bs:
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a multiple of the block size ({bs})")
        self.engine = engine
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.fingerprint = engine.loaded.fingerprint

    def _meta(self, exact: bool) -> ChunkMeta:
        return ChunkMeta(
            fingerprint=self.fingerprint,
            kv_format=DENSE_FORMAT if exact else LOSSY_FORMAT,
            dtype=str(self.engine.pool.kv.dtype).removeprefix("torch."),
            block_size=self.chunk_tokens,
            quant="none",
        )

    def save(self, session_id: str, seq: "Sequence", previous: SavedKV) -> tuple[SavedKV, SaveResult]:
        """Write the chunks of ``seq``'s computed tokens that ``previous`` does not
        already hold, then point the session at the new chunk list (one commit).

        Full chunks whose tokens are unchanged are reused by hash; new full
        chunks and the partial tail are written. Files are durable before the
        index names them. KV of an inexact sequence (one restored from a
        quantized tier) is written under :data:`LOSSY_FORMAT`.

        Raises:
            StorageWriteError: disk full, read-only home, index failure. The
                previous state on disk is intact.
        """
        pool = self.engine.pool
        C = self.chunk_tokens
        with self.engine.lock:
            ids = list(seq.computed_ids)
            exact = seq.exact
            keep: list[ChunkInfo] = []
            off = 0
            for info in previous.chunks:
                if info.n_tokens != C or ids[off : off + C] != previous.token_ids[off : off + C]:
                    break
                keep.append(info)
                off += C
            pieces = []
            while off < len(ids):
                n = min(C, len(ids) - off)
                pieces.append((n, pool.read_tokens(seq, off, n)))
                off += n
        meta = self._meta(exact)
        new = [NewChunk(n, {KV_TENSOR: kv.to("cpu")}, meta) for n, kv in pieces]
        result = self.store.save_kv(session_id, token_ids=ids, fingerprint=self.fingerprint, chunks=[*keep, *new])
        return SavedKV(ids, list(result.chunks)), result

    def restore(self, session_id: str, seq: "Sequence", info: RestoreInfo) -> SavedKV:
        """Load the session's KV into empty ``seq``: first whatever prefix the pool
        already holds (shared blocks), then the remaining tokens chunk by chunk.

        Never raises for bad KV: a fingerprint mismatch invalidates the stored KV,
        a corrupt or missing chunk is quarantined (by storage) and the valid
        prefix before it is kept; ``info.warning`` says what happened. The next
        turn re-prefills whatever is missing.

        Returns:
            What is on disk now (the basis of the next incremental save).
        """
        store, engine = self.store, self.engine
        session = store.get_session(session_id)
        if session.n_cached == 0:
            return SavedKV()
        if session.fingerprint != self.fingerprint:
            info.warning = (
                f"session {session_id!r}: its KV cache was made by another model, dtype, tokenizer, "
                "chat template or chatkv version; re-prefilling from history"
            )
            store.invalidate_kv(session_id)
            return SavedKV()
        cached_ids = store.cached_token_ids(session_id)
        with engine.lock:
            # Blocks other sessions hold for the same prefix are shared, not reloaded.
            engine.pool.match_prefix(seq, cached_ids + [-1])
        chunks: list[ChunkInfo] = []
        off = 0
        try:
            for loaded in store.iter_kv(session_id, fingerprint=self.fingerprint):
                n = loaded.info.n_tokens
                chunks.append(loaded.info)
                info.bytes_read += loaded.info.bytes
                kv = loaded.tensors.get(KV_TENSOR)
                L, two, _, _, h, d = engine.pool.kv.shape
                if kv is None or tuple(kv.shape) != (L, two, n, h, d):
                    reason = f"tensor {KV_TENSOR!r} has shape {None if kv is None else tuple(kv.shape)}, " \
                             f"not {(L, two, n, h, d)}"
                    raise CorruptChunkError(loaded.info.hash, reason,
                                            store.quarantine_chunk(loaded.info.hash, reason))
                skip = seq.num_computed - off
                if skip < n:
                    with engine.lock:
                        engine.pool.write_tokens(seq, loaded.token_ids[skip:], kv[:, :, skip:],
                                                 exact=loaded.info.kv_format == DENSE_FORMAT)
                off += n
        except OutOfBlocksError:
            # No room for the rest: keep the prefix loaded so far (the turn re-prefills the rest).
            chunks = chunks[:-1]
            info.warning = f"session {session_id!r}: the KV pool is full; loaded {seq.num_computed} tokens"
        except CorruptChunkError as exc:
            info.warning = f"session {session_id!r}: {exc}; re-prefilling from that point"
            chunks = chunks[:-1] if chunks and chunks[-1].hash == exc.chunk_hash else chunks
        else:
            return SavedKV(cached_ids, chunks)
        good = sum(c.n_tokens for c in chunks)
        with engine.lock:
            if seq.num_computed > good:
                engine.pool.truncate(seq, good)
        return SavedKV(cached_ids[:good], chunks)
