"""Moving a session's KV between the block pool and disk chunks.

A session's computed tokens are cut into chunks of ``chunk_tokens`` (a multiple
of the block size) plus a partial tail. Each chunk is one content-addressed
safetensors file holding ``kv``: ``[num_layers, 2, n_tokens, kv_heads,
head_dim]`` in the model's dtype, token-major so files do not depend on the
pool's block size. Chunk hashes chain over the parent hash, the token ids, the
model fingerprint and the KV format, so a system prompt shared by many sessions
is one file, and a new turn writes only the chunks it completed plus its tail.

The pool belongs to the engine's loop, so both directions are split: a save
takes a :class:`Snapshot` of the new tokens' KV on the loop (a copy, quick)
and writes files in the caller's thread; a restore has the loop reserve slots
for the KV, reads the chunk files straight into them off the loop (or, for a
compact chunk, hands its tensors to the loop to dequantize into them), and has
the loop commit what was read and verified.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatkv.config import switched_off
from chatkv.errors import OutOfBlocksError
from chatkv.kvcodec import PackedPart, pack, packed_format, packed_layout, parse_packed, unpack, unpack_into
from chatkv.models import KV_FORMAT_VERSION
from chatkv.runner import StepInput
from chatkv.sequence import Sequence, Shift
from chatkv.stats import RestoreInfo
from chatkv.threads import in_passing_thread
from chatkv.storage import (
    ChunkInfo,
    ChunkMeta,
    ChunkSource,
    Converted,
    CorruptChunkError,
    MissingChunkError,
    NewChunk,
    SaveResult,
    SessionInfo,
    PlaneSpans,
    Planes,
    Store,
    StoredKV,
    default_db_url,
    default_home,
)

if TYPE_CHECKING:
    import torch

    from chatkv.block_pool import BlockHash
    from chatkv.engine import Engine
    from chatkv.tiers import TieredKV

log = logging.getLogger(__name__)

KV_TENSOR = "kv"
#: Threads reading a restore's chunks into the pool at once: each opens a file,
#: reads it into its slots and checks its checksum there (both release the GIL).
RESTORE_READERS = 2
#: Chunks a restore has opened or read but not yet counted (nor, for a chunk
#: read into memory of its own, written into the pool): the readers run this
#: far ahead of the chunk the restore waits for.
RESTORE_AHEAD = 4 * RESTORE_READERS
#: ``0`` leaves the reader threads wherever the kernel schedules them
#: (by default each keeps to a CPU of its own, :func:`_pin_reader`).
PIN_READERS_ENV = "CHATKV_PIN_READERS"
_READERS: ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()
_READERS_STARTED = [0]  # reader threads started in this process, for _pin_reader


def _restore_readers() -> ThreadPoolExecutor:
    """The process's restore reader threads (:data:`RESTORE_READERS`), started on
    first use and kept: starting two threads for every restore cost it 2 to 4 ms.
    Each keeps to a CPU of its own (:func:`_pin_reader`)."""
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(RESTORE_READERS, thread_name_prefix="chatkv-restore-read",
                                          initializer=_pin_reader)
        return _READERS


def _pin_reader() -> None:
    """In a reader thread as it starts: keep it to one CPU of the process's,
    the readers spread evenly over them, where there are at least as many as
    readers (Linux; not with ``CHATKV_PIN_READERS=0``).

    A restore's calling thread hands both readers their chunks at once, and
    the kernel wakes a thread on the CPU of the thread that woke it: on this
    project's 2-CPU VM the two readers then often ran one after the other on
    one CPU while the other CPU idled, each waiting 1.5 to 4.5 ms of a 9 ms
    restore to run (``/proc/thread-self/schedstat``). Kept apart, one engine
    restored a 1,494-token bfloat16 session in 7.36 ms against 8.15 (6.49
    with the native chunk reads; 20 restores per variant, alternating).
    """
    with _READERS_LOCK:
        index = _READERS_STARTED[0]
        _READERS_STARTED[0] += 1
    if switched_off(PIN_READERS_ENV) or not hasattr(os, "sched_setaffinity"):
        return
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < RESTORE_READERS:
            return
        cpu = cpus[(index % RESTORE_READERS) * len(cpus) // RESTORE_READERS]
        os.sched_setaffinity(0, {cpu})  # 0: this thread
    except OSError as exc:  # a container that forbids it: the reader goes on unpinned
        log.info("could not keep restore reader %d to one CPU: %s", index, exc)


def _device_bytes_read() -> int | None:
    """Bytes the calling thread has had read from a storage device, not served
    from the page cache (``read_bytes`` of ``/proc/thread-self/io``), or None
    where the system does not say."""
    try:
        with open("/proc/thread-self/io", "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def start_restore_readers() -> None:
    """Start the process's restore reader threads now, if they are not running
    (the engine's warm-up does), so that a first restore does not start them."""
    readers = _restore_readers()
    meet = threading.Barrier(RESTORE_READERS, timeout=10)  # every reader at once: each a thread of its own
    wait_all([readers.submit(meet.wait) for _ in range(RESTORE_READERS)])


def _forget_readers() -> None:  # a forked child has none of its parent's threads
    global _READERS
    _READERS = None
    _READERS_STARTED[0] = 0


os.register_at_fork(after_in_child=_forget_readers)

#: Tokens of imported KV recomputed to check it against the model.
PROBE_TOKENS = 16
#: Error allowed, relative to the largest magnitude, when probing imported compact KV, per scheme.
PACKED_TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "int8": 3e-2, "fp8": 8e-2, "int4": 0.2}
DENSE_FORMAT = f"{KV_FORMAT_VERSION}:dense"
#: Full-precision layout, but KV computed from (or restored out of) a quantized
#: tier: a distinct format, so its chunk hashes never collide with exact ones.
LOSSY_FORMAT = f"{KV_FORMAT_VERSION}:dense-lossy"
#: Separates a shifted sequence's :attr:`~chatkv.sequence.Shift.tag` from its
#: format: the chunks of a session whose window the sink policy shifted are
#: stored as ``<format>+sh:s<sink>.d<dropped>.<key>``. The tag is part of the
#: chunk hash, so shifted KV never collides with unshifted KV of the same
#: tokens, and a restore reads the shift back from it (all of a session's
#: chunks carry the same tag; a restore stops at one that does not).
SHIFT_SEP = "+sh:"


def kv_format_for(exact: bool, shift: Shift | None, packed: tuple[str, int] | None = None) -> str:
    """The ``kv_format`` of chunks of a sequence that is ``exact`` (or not) and has
    ``shift``, written dense or ``packed`` as ``(scheme, block size)`` (:mod:`chatkv.kvcodec`)."""
    if packed is not None:
        base = packed_format(KV_FORMAT_VERSION, *packed)
    else:
        base = DENSE_FORMAT if exact else LOSSY_FORMAT
    return base if shift is None else f"{base}{SHIFT_SEP}{shift.tag}"


def parse_kv_format(kv_format: str) -> tuple[str, Shift | None]:
    """``(base format, shift)`` of a chunk's ``kv_format`` (see :func:`kv_format_for`).

    Raises:
        ValueError: a malformed shift tag.
    """
    base, sep, tag = kv_format.partition(SHIFT_SEP)
    if not sep:
        return base, None
    sink, dropped, key = tag.split(".")
    if not (sink.startswith("s") and dropped.startswith("d")):
        raise ValueError(f"not a shift tag: {tag!r}")
    return base, Shift(int(sink[1:]), int(dropped[1:]), bytes.fromhex(key))

_STORES: dict[tuple[str, str], Store] = {}
_STORES_LOCK = threading.Lock()


def saved_from(stored: StoredKV) -> SavedKV:
    """What a session whose chunk list is ``stored`` has on disk, as the basis
    of its next save (:class:`SavedKV`); empty if its format tag is unreadable."""
    try:
        shift = parse_kv_format(stored.chunks[0].kv_format)[1] if stored.chunks else None
    except ValueError:
        return SavedKV()
    return SavedKV(list(stored.token_ids), list(stored.chunks), shift)


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
    shift: Shift | None = None


@dataclass
class Snapshot:
    """The KV a save writes, copied out of the pool on the loop.

    ``keep`` are the previous save's chunks still valid; ``pieces`` the new
    chunks' ``(token count, KV tensor on the CPU)``.
    """

    token_ids: list[int]
    exact: bool
    keep: list[ChunkInfo]
    pieces: list[tuple[int, "torch.Tensor"]]
    shift: Shift | None = None
    scheme: str = "none"
    """How the new chunks are written: ``none`` (dense) or a compact :mod:`chatkv.quant` scheme."""


class KVPersister:
    """Saves a session's KV as chunks and restores it into the engine's pool."""

    def __init__(self, engine: "Engine", store: Store, chunk_tokens: int) -> None:
        """Persist ``engine``'s sequences into ``store`` in chunks of ``chunk_tokens``."""
        bs = engine.pool.block_size
        if chunk_tokens % bs:
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a multiple of the block size ({bs})")
        self.engine = engine
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.fingerprint = engine.loaded.fingerprint

    def _meta(self, exact: bool, shift: Shift | None = None, scheme: str = "none") -> ChunkMeta:
        packed = None if scheme == "none" else (scheme, self.engine.pool.block_size)
        return ChunkMeta(
            fingerprint=self.fingerprint,
            kv_format=kv_format_for(exact, shift, packed),
            dtype=str(self.engine.pool.kv.dtype).removeprefix("torch."),
            block_size=self.chunk_tokens,
            quant=scheme,
        )

    # -- save --------------------------------------------------------------------------

    def snapshot(self, seq: "Sequence", previous: SavedKV) -> Snapshot:
        """On the loop: copy the KV of ``seq``'s computed tokens that ``previous``
        does not already hold (full chunks whose tokens are unchanged are kept by
        hash; none once the window shifted since, as every kept key moved)."""
        pool = self.engine.pool
        C = self.chunk_tokens
        ids = list(seq.computed_ids)
        keep: list[ChunkInfo] = []
        off = 0
        for info in previous.chunks if previous.shift == seq.shift else ():
            if info.n_tokens != C or ids[off : off + C] != previous.token_ids[off : off + C]:
                break
            keep.append(info)
            off += C
        pieces = []
        while off < len(ids):
            n = min(C, len(ids) - off)
            pieces.append((n, pool.read_tokens(seq, off, n).to("cpu")))
            off += n
        return Snapshot(ids, seq.exact, keep, pieces, seq.shift, self.engine.tiers.effective_disk_scheme())

    def write(self, session_id: str, snap: Snapshot) -> tuple[SavedKV, SaveResult]:
        """Write a snapshot's new chunks, then point the session at the new chunk
        list (one commit). Files are durable before the index names them. KV of
        an inexact sequence (restored from a quantized tier) is written under
        :data:`LOSSY_FORMAT`.

        Raises:
            StorageWriteError: disk full, read-only home, index failure. The
                previous state on disk is intact.
        """
        meta = self._meta(snap.exact, snap.shift, snap.scheme)
        if snap.scheme == "none":
            new = [NewChunk(n, {KV_TENSOR: kv}, meta) for n, kv in snap.pieces]
        else:
            bs = self.engine.pool.block_size
            # Quantized in a thread that exits: torch gives the thread that runs
            # its operators an OpenMP pool for good, and a second pool beside the
            # loop's slows every later operator of the loop (chatkv.threads).
            new = in_passing_thread(lambda: [NewChunk(n, pack(kv, snap.scheme, bs), meta) for n, kv in snap.pieces])
        result = self.store.save_kv(session_id, token_ids=snap.token_ids, fingerprint=self.fingerprint,
                                    chunks=[*snap.keep, *new])
        return SavedKV(snap.token_ids, list(result.chunks), snap.shift), result

    # -- restore -----------------------------------------------------------------------

    def restore(self, kv: "TieredKV", info: RestoreInfo, *, need_room: bool = False,
                session: SessionInfo | None = None, stored: StoredKV | None = None) -> SavedKV | None:
        """The one restore path: load the session's stored KV into its empty
        sequence, first whatever prefix the pool already holds (shared blocks),
        then the rest from its chunk files (see :meth:`_load`). The caller
        keeps ``kv`` pinned meanwhile.

        With ``need_room``, a restore that would not fit the pool even after
        demoting idle sessions is not started: None is returned and the KV stays
        on disk (a turn restores it later). ``session`` is the session's row as
        the caller read it under the session's lease just before (the open
        does: it saves a query); without it, it is read here. ``stored`` is
        its chunk list, likewise (:meth:`Store.open_kv`, read by the open on
        its own thread while it holds the GIL alone: 1.2 ms there against 3.5
        on the restore's thread beside the turn's template).

        Otherwise never raises for bad KV: a fingerprint mismatch invalidates
        the stored KV, a corrupt or missing chunk is quarantined (by storage)
        and the valid prefix before it is kept; ``info.warning`` says what
        happened. The next turn re-prefills whatever is missing.

        Returns:
            What is on disk now (the basis of the next incremental save).
        """
        engine, store = self.engine, self.store
        started = time.perf_counter()
        if session is None:
            session = store.get_session(kv.session_id)
        saved = SavedKV()
        try:
            if session.n_cached == 0:
                engine.call(lambda: engine.tiers.restored(kv), "restored")
                return saved
            if session.fingerprint != self.fingerprint:
                info.warning = (
                    f"session {kv.session_id!r}: its KV cache was made by another model, dtype, tokenizer, "
                    "chat template or chatkv version; re-prefilling from history"
                )
                kv.lost = "its stored KV was made by another model"
                store.invalidate_kv(kv.session_id)
                engine.call(lambda: engine.tiers.restored(kv), "restored")
                return saved
            if not session.kv_verified and not self.verify(kv.session_id, session.kv_generation):
                info.warning = (f"session {kv.session_id!r}: its imported KV does not match this model's own "
                                "keys and values; re-prefilling from history")
                kv.lost = "its imported KV did not match the model"
                store.invalidate_kv(kv.session_id)
                engine.call(lambda: engine.tiers.restored(kv), "restored")
                return saved
            if stored is None:
                stored = store.open_kv(kv.session_id, fingerprint=self.fingerprint)
            cached_ids, infos = stored.token_ids, stored.chunks
            try:
                shift = parse_kv_format(infos[0].kv_format)[1] if infos else None
            except ValueError:
                shift = None  # an unreadable tag: _load stops at the first chunk, the turn re-prefills
            choice = engine.costs.choose(len(cached_ids), sum(i.bytes for i in infos))
            info.decision, info.reason = choice.decision, choice.reason
            if choice.decision == "recompute" and shift is None:  # a shifted window cannot be re-prefilled as is
                log.info("session %s: %s", kv.session_id, choice.reason)
                kv.lost = choice.reason
                engine.call(lambda: engine.tiers.restored(kv), "restored")
                return SavedKV(cached_ids, infos)  # still on disk: the next save keeps what it can
            info.decision = "restore"
            plan = engine.call(lambda: self._begin(kv, stored, need_room, shift), "begin restore")
            if plan is None:
                return None
            load_started = time.perf_counter()
            saved = self._load(kv, stored, plan, info, shift)
            if not info.warning:
                engine.costs.record_restore(info.bytes_read, time.perf_counter() - load_started)
            return saved
        finally:
            info.seconds = time.perf_counter() - started
            if info.warning:
                log.warning("%s", info.warning)
            else:
                log.info("session %s: restored %d tokens (%d bytes read) in %.3f s", kv.session_id,
                         kv.seq.num_computed, info.bytes_read, info.seconds)

    def verify(self, session_id: str, kv_generation: int) -> bool:
        """Check stored KV that the store cannot vouch for (an imported bundle)
        against the model: recompute the first :data:`PROBE_TOKENS` tokens' keys
        and values and compare them with the first stored chunk. KV claiming
        this model's fingerprint but made by another model, or corrupted,
        fails; a pass is recorded (:meth:`Store.mark_kv_verified`)."""
        import torch

        first = next(iter(self.store.iter_kv(session_id, fingerprint=self.fingerprint)), None)
        if first is None:
            return False
        try:
            base, shift = parse_kv_format(first.info.kv_format)
            packed = parse_packed(base, KV_FORMAT_VERSION)
        except ValueError:
            return False
        L, two, _, _, h, d = self.engine.pool.kv.shape
        stored, _ = self._dense(first.tensors, base, (L, two, first.info.n_tokens, h, d))
        if stored is None:
            return False
        n = min(PROBE_TOKENS, first.info.n_tokens)
        if shift is not None:  # past its sink, shifted KV is not what a fresh prefill computes
            n = min(n, shift.sink)
            if n == 0:
                return False
        ids = list(first.token_ids[:n])
        engine = self.engine

        def recompute() -> "torch.Tensor":
            seq = Sequence(token_ids=list(ids))
            try:
                engine.runner.forward([StepInput(seq, list(ids))])
                return engine.pool.read_tokens(seq, 0, n).to("cpu", torch.float32)
            finally:
                engine.pool.release(seq)

        try:
            fresh = engine.call(recompute, "verify imported KV")
        except OutOfBlocksError:
            return False  # no room to check now: not used this time, checked again later
        probe = stored[:, :, :n].to(torch.float32)
        if probe.shape != fresh.shape or not bool(torch.isfinite(probe).all()):
            return False
        # Chunked vs whole prefill, in the model's dtype; a compact chunk also carries its scheme's error.
        scale = 1e-2 if packed is None else PACKED_TOLERANCE.get(packed[0], 0.2)
        tolerance = scale * float(fresh.abs().max()) + 1e-3
        if float((probe - fresh).abs().max()) > tolerance:
            return False
        self.store.mark_kv_verified(session_id, kv_generation=kv_generation)
        return True

    def _begin(self, kv: "TieredKV", stored: StoredKV, need_room: bool,
               shift: Shift | None = None) -> "_RestorePlan | None":
        """On the loop: attach the shared prefix (of a sequence with ``shift``),
        make room for the rest and reserve its slots, whole chunks as far as
        they fit (see :class:`_RestorePlan`). None if ``need_room`` and the
        pool has not room for all of it."""
        pool = self.engine.pool
        cached_ids = stored.token_ids
        matched, _ = pool.prefix_plan(cached_ids + [-1], shift)
        need = -(-len(cached_ids) // pool.block_size) - matched // pool.block_size
        if not self.engine.tiers.reclaim(need, exclude=kv) and need_room:
            return None
        # Blocks other sessions hold for the same prefix are shared, not reloaded.
        seq = kv.seq
        seq.shift = shift
        pool.match_prefix(seq, cached_ids + [-1])
        seq.token_ids = list(cached_ids[: seq.num_computed])
        start = end = seq.num_computed
        off = 0
        for chunk in stored.chunks:  # the last chunk boundary whose tokens fit
            off += chunk.n_tokens
            if off > start and pool.blocks_needed(seq, off - start) <= pool.num_available:
                end = off
        slots = pool.reserve(seq, cached_ids[start:end]) if end > start else []
        planes = pool.slot_planes(seq, start, end - start)
        if planes is not None:  # (checked once here: each chunk's read into them then checks two numbers)
            planes = Planes(*planes)
        return _RestorePlan(start, end, slots, planes, seq.block_hashes[-1] if seq.block_hashes else None)

    def _finish(self, kv: "TieredKV", plan: "_RestorePlan", exact_until: int, good: int,
                ahead: "dict[int, BlockHash] | None" = None) -> None:
        """On the loop: commit the reserved tokens that were filled and verified
        (up to ``good``; KV past ``exact_until`` came from a lossy format and
        marks the sequence inexact; ``ahead``: their blocks' hashes, computed
        while the chunks were read, see :meth:`BlockPool.chain_hashes`), give
        back the rest of the reservation, and tell the tier policy the session
        is back."""
        pool, seq = self.engine.pool, kv.seq
        exact = max(plan.start, min(exact_until, good))
        pool.commit(seq, exact - plan.start, ahead)
        if good > exact:
            seq.exact = False
            pool.commit(seq, good - exact, ahead)
        if len(seq.token_ids) > seq.num_computed:
            pool.truncate(seq, seq.num_computed)
        self.engine.tiers.restored(kv)

    def _dense(self, tensors: dict[str, "torch.Tensor"], base: str,
               shape: tuple[int, int, int, int, int]) -> tuple["torch.Tensor | None", str]:
        """A chunk's KV as the pool's dense layout (unpacking a compact chunk), or
        ``(None, why)`` when its tensors do not fit ``shape`` or its format."""
        try:
            packed = parse_packed(base, KV_FORMAT_VERSION)
            if packed is not None:
                return unpack(tensors, packed[0], packed[1], shape, self.engine.pool.kv.dtype), ""
        except ValueError as exc:
            return None, f"packed KV: {exc}"
        tensor = tensors.get(KV_TENSOR)
        if tensor is None or tuple(tensor.shape) != shape:
            return None, f"tensor {KV_TENSOR!r} has shape {None if tensor is None else tuple(tensor.shape)}, " \
                         f"not {shape}"
        return tensor, ""

    def _load(self, kv: "TieredKV", stored: StoredKV, plan: "_RestorePlan", info: RestoreInfo,
              shift: Shift | None = None) -> SavedKV:
        """Fill the slots ``plan`` reserved from the session's chunk files, then
        commit what was read and verified (see :meth:`_finish`).

        The process's reader threads (:data:`RESTORE_READERS`) open, read and
        check the chunks, up to :data:`RESTORE_AHEAD` at a time, while this
        thread takes them in order (:meth:`_read_chunk`). On a host pool, a
        chunk in the pool's own layout is read straight into its slots
        (:meth:`ChunkSource.read_into`: one copy, the checksum taken over each
        slice where it landed), and so is a compact chunk where the native
        reads can dequantize it as it lands (:meth:`_converted`); any other
        chunk (compact without the native reads, or of a device pool) is read
        into memory of its own and written into its slots by the loop (which
        dequantizes it): on a device, or where reads wait for the disk, as it
        comes, beside the next reads; on the CPU, reading from the page cache,
        up to :data:`RESTORE_AHEAD` at once with the readers idle.
        Chunks wholly inside the shared prefix are not read at all. What
        counts is the longest run of chunks from the start that all read and
        verified.
        """
        engine = self.engine
        L, two, _, _, h, d = engine.pool.kv.shape
        row = h * d * engine.pool.kv.element_size()
        chunks: list[ChunkInfo] = []  # chunks whose KV is in the pool (or shared), in order
        pending: deque[_ChunkRead] = deque()  # being read, not yet known good, in order
        fills: list[tuple[_ChunkRead, dict[str, torch.Tensor]]] = []  # read into memory of their own, in order
        # On the CPU the loop's fills wait for the readers to be idle while the
        # reads copy from the page cache: its operators' threads and the readers
        # busy on the same cores made both several times slower (an int4
        # chunk's fill 18 ms against 3). Reads that wait for the device leave
        # the cores free: the loop then fills beside them.
        apart = engine.pool.kv.device.type == "cpu"
        good = exact_until = plan.start

        def count(read: _ChunkRead) -> None:
            nonlocal good, exact_until
            if read.base == DENSE_FORMAT and exact_until == good:  # packed KV is lossy
                exact_until = read.end
            good = read.end
            chunks.append(read.chunk)

        def flush() -> None:
            """Have the loop write the chunks read into memory of their own into
            their slots (dequantizing them), then count them, in order."""
            if not fills:
                return
            batch = list(fills)
            fills.clear()
            reasons = engine.call(lambda: [self._fill(t, r.base, (L, two, r.n, h, d), r.skip, r.slots)
                                           for r, t in batch], "restore chunks")
            for (read, _), reason in zip(batch, reasons):
                if reason:
                    raise CorruptChunkError(read.chunk.hash, reason,
                                            self.store.quarantine_chunk(read.chunk.hash, reason))
                count(read)

        def settle(keep: int = 0) -> None:
            """Count the leading chunks whose reads are done as good (a chunk read
            into memory of its own once the loop has written it into its
            slots), waiting until at most ``keep`` are left in flight."""
            try:
                while pending and (len(pending) > keep or pending[0].done.done()):
                    read = pending.popleft()
                    try:
                        tensors, waited = read.done.result()  # CorruptChunkError once quarantined
                    except BaseException:  # (an OSError too): nothing from here on counts
                        wait_all([r.done for r in pending])  # the readers idle (on the CPU)...
                        flush()  # ...while the loop writes the good chunks before it
                        raise
                    if tensors is None:
                        flush()
                        count(read)
                        continue
                    fills.append((read, tensors))
                    if not apart or waited or len(fills) >= RESTORE_AHEAD or not pending:
                        wait_all([r.done for r in pending] if apart and not waited else [])
                        flush()
                if keep == 0:
                    flush()
            except BaseException:
                for later in pending:  # what was read after it cannot be used; let it finish
                    later.done.exception()
                pending.clear()
                fills.clear()
                raise

        off = 0
        failure: CorruptChunkError | None = None
        unread = False  # chunks left on disk for want of room in the pool (still valid there)
        ahead: dict[int, BlockHash] | None = None  # the reserved blocks' hashes, for the commit
        readers = _restore_readers()
        submitted: list[Future] = []  # all waited for before the restore ends, whatever happens
        try:
            for index, chunk in enumerate(stored.chunks):
                n = chunk.n_tokens
                try:
                    base, chunk_shift = parse_kv_format(chunk.kv_format)
                except ValueError:
                    base, chunk_shift = chunk.kv_format, ...
                stop = None
                if chunk_shift != shift:  # never mix shifted and unshifted (or differently shifted) KV
                    info.warning = (f"session {kv.session_id!r}: its stored KV mixes windows shifted differently; "
                                    "re-prefilling from there")
                    kv.lost = stop = "its stored KV mixed differently shifted windows"
                elif off + n > plan.end:
                    info.warning = stop = f"session {kv.session_id!r}: the KV pool is full; loaded part of its KV"
                    unread = True
                if stop is not None:
                    break
                if off + n <= plan.start:
                    chunks.append(chunk)  # wholly in the shared prefix: not read
                    off += n
                    continue
                skip = max(0, plan.start - off)
                lo, hi = off + skip - plan.start, off + n - plan.start  # the chunk's reserved slots
                info.bytes_read += chunk.bytes
                into = (plan.planes, skip * row, lo * row, hi * row) if plan.planes is not None else None
                done = readers.submit(self._read_chunk, stored, index, base, (L, two, n, h, d), into)
                submitted.append(done)
                pending.append(_ChunkRead(done, chunk, base, n, off + n, skip, plan.slots[lo:hi]))
                off += n
                settle(keep=RESTORE_AHEAD - 1)
            # While the last chunks are read (the readers mostly in C, without the
            # GIL): the hashes the loop's commit would otherwise compute after them.
            bs = engine.pool.block_size
            if plan.start % bs == 0:  # (a shared prefix is whole blocks: the chain goes on from its last)
                ahead = engine.pool.chain_hashes(plan.parent, stored.token_ids[plan.start: plan.end // bs * bs],
                                                 plan.start // bs, shift)
        except CorruptChunkError as exc:
            failure = exc
        finally:
            try:
                settle()
            except CorruptChunkError as exc:
                failure = failure or exc
            finally:
                wait_all(submitted)  # no reader still writes into slots _finish may give back
                engine.call(lambda: self._finish(kv, plan, exact_until, good, ahead), "finish restore")
        if failure is not None:
            info.warning = f"session {kv.session_id!r}: {failure}; re-prefilling from that point"
            kv.lost = (f"stored KV chunk {failure.chunk_hash[:12]} is missing"
                       if isinstance(failure, MissingChunkError)
                       else f"stored KV chunk {failure.chunk_hash[:12]} failed verification and was quarantined")
        info.cached_tokens = kv.seq.num_computed
        if unread and failure is None and len(chunks) == index:  # all read up to the room: the rest stays valid
            return saved_from(stored)
        kept = sum(c.n_tokens for c in chunks)
        return SavedKV(stored.token_ids[:kept], chunks, shift)

    def _read_chunk(self, stored: StoredKV, index: int, base: str, shape: tuple[int, int, int, int, int],
                    into: "tuple[Planes, int, int, int] | None",
                    ) -> "tuple[dict[str, torch.Tensor] | None, bool]":
        """In a reader thread: open chunk ``index`` of ``stored`` (its format
        ``base``) and read it, checksum checked. With ``into`` (where the
        restore's slots lie in the pool, :attr:`_RestorePlan.planes`; the bytes
        of the chunk's tokens in the shared prefix, which go to scratch; and
        the byte range of its reserved slots in each plane's runs), straight
        into those slots where it can be: a KV tensor of the pool's dtype and
        ``shape`` as it is, a compact chunk dequantized as it is read
        (:meth:`_converted`); returns None. Otherwise into memory of its own:
        returns its tensors, for :meth:`_fill` on the loop.
        Also returns whether most of its bytes came from the device rather
        than the page cache (:func:`_device_bytes_read`).

        Raises:
            CorruptChunkError, MissingChunkError: after quarantining the chunk.
        """
        source = stored.open(index)
        if into is not None and source.shapes.get(KV_TENSOR) == (self.engine.pool.kv.dtype, shape):
            planes, shared, lo, hi = into
            if not shared:  # every plane's stretch in one piece, the C function walking them
                source.read_into({KV_TENSOR: planes.span(lo, hi)})
                return None, False  # (only a chunk the loop writes needs to know)
            # A scratch piece per layer: the Python read path fills several pieces per
            # preadv before hashing them, so one piece used twice would lose bytes.
            # (_converted's codes are hashed in the native call's own buffer: one serves.)
            scratch = memoryview(bytearray(len(planes.starts) * shared))
            buffers: list[memoryview] = []
            for j in range(len(planes.starts)):
                buffers.append(scratch[j * shared: (j + 1) * shared])
                buffers.extend(planes.views(j, lo, hi))
            source.read_into({KV_TENSOR: buffers})
            return None, False
        converted = self._converted(source, base, shape, into) if into is not None else None
        if converted is not None:
            source.read_into(*converted)
            return None, False
        before = _device_bytes_read()
        tensors = source.read_into({})
        after = _device_bytes_read()
        return tensors, before is not None and after is not None and 2 * (after - before) > source.info.bytes

    def _converted(self, source: ChunkSource, base: str, shape: tuple[int, int, int, int, int],
                   into: "tuple[Planes, int, int, int]",
                   ) -> "tuple[dict[str, list[memoryview] | PlaneSpans], dict[str, Converted]] | None":
        """``(buffers, converted)`` for :meth:`ChunkSource.read_into` that read
        a compact chunk (:func:`chatkv.kvcodec.packed_layout`) straight into
        its slots (``into``, as :meth:`_read_chunk` takes it), dequantizing
        the codes as they land, the exact tail read as it is; the same
        values, bit for bit, as :meth:`_fill` writes. None where it cannot be
        read so (no native reads, a pool neither float32 nor bfloat16,
        another format or layout): the chunk is then read into memory and
        filled by the loop.
        """
        import torch

        dtype = self.engine.pool.kv.dtype
        if dtype not in (torch.float32, torch.bfloat16) or not source.converts():
            return None
        layout = _packed_layout(base, tuple(source.shapes.items()), shape, dtype)
        if layout is None:
            return None
        full, parts = layout
        planes, shared, lo, hi = into
        L, _, n, h, d = shape
        row = h * d * dtype.itemsize
        if shared > full * row:  # (a shared prefix ends at a block boundary, inside the quantized blocks)
            return None
        edge = lo + full * row - shared  # where the chunk's tail starts in its reserved bytes
        converted = {}
        if not shared:  # as PlaneSpans (see _read_chunk)
            for first, part in enumerate(parts):  # K's planes, then V's
                converted[part.codes] = Converted(planes.span(lo, edge, first, 2), dtype, part.row, part.scale,
                                                  part.zero, part.block, part.group)
            return {"tail": planes.span(edge, hi) if edge < hi else []}, converted  # (a full chunk has none)
        scratch = memoryview(bytearray(shared))  # the codes of tokens in the shared prefix land here, unused
        for i, part in enumerate(parts):
            buffers = [piece for layer in range(L) for piece in [scratch, *planes.views(2 * layer + i, lo, edge)]]
            converted[part.codes] = Converted(buffers, dtype, part.row, part.scale, part.zero, part.block,
                                              part.group)
        tail = [piece for layer in range(L) for i in range(2) for piece in planes.views(2 * layer + i, edge, hi)]
        return {"tail": tail}, converted

    def _fill(self, tensors: dict[str, "torch.Tensor"], base: str, shape: tuple[int, int, int, int, int],
              skip: int, slots: list[int]) -> str:
        """On the loop: write a chunk read into memory of its own (dequantizing a
        compact one) into its reserved ``slots``, past its first ``skip`` tokens.
        Returns "" or why the chunk's tensors do not fit its format."""
        pool = self.engine.pool
        try:
            packed = parse_packed(base, KV_FORMAT_VERSION)
            if packed is not None:
                unpack_into(tensors, packed[0], packed[1], shape,
                            [(skip + at, view) for at, view in pool.slot_views(slots)])
                return ""  # dequantized straight into the slots
        except ValueError as exc:
            return f"packed KV: {exc}"
        tensor, reason = self._dense(tensors, base, shape)
        if tensor is not None:
            pool.fill(slots, tensor[:, :, skip:])
        return reason


@functools.lru_cache(maxsize=256)
def _packed_layout(base: str, shapes: tuple[tuple[str, tuple["torch.dtype", tuple[int, ...]]], ...],
                   shape: tuple[int, int, int, int, int], dtype: "torch.dtype") -> tuple[int, list[PackedPart]] | None:
    """:func:`chatkv.kvcodec.packed_layout` of a chunk of format ``base`` whose
    tensors are ``shapes`` (items of :attr:`ChunkSource.shapes`), None where
    ``base`` is not a packed format; kept for the chunks that follow (a
    restore's chunks but its last share one)."""
    try:
        packed = parse_packed(base, KV_FORMAT_VERSION)
    except ValueError:
        return None
    return None if packed is None else packed_layout(dict(shapes), packed[0], packed[1], shape, dtype)


@dataclass
class _ChunkRead:
    """One chunk of a restore being read (see :meth:`KVPersister._load`).

    Attributes:
        done: the read (:meth:`KVPersister._read_chunk`): None once in its
            slots, or the tensors it read into memory of their own.
        chunk: the chunk.
        base: its format, less any shift tag.
        n: its tokens.
        end: the session's tokens up to its end.
        skip: its first tokens, in the shared prefix, not written.
        slots: the slots reserved for the rest.
    """

    done: Future
    chunk: ChunkInfo
    base: str
    n: int
    end: int
    skip: int
    slots: list[int]


@dataclass
class _RestorePlan:
    """What :meth:`KVPersister._begin` reserved for a restore.

    Attributes:
        start: tokens the shared prefix covers (attached, not read).
        end: tokens covered once the reserved slots are filled: a chunk
            boundary, the whole stored KV unless the pool is short.
        slots: the slots of tokens ``start .. end - 1``.
        planes: where they lie in the pool's memory (:meth:`BlockPool.slot_planes`), on a host pool.
        parent: the hash of the block before the first reserved one (None at the start).
    """

    start: int
    end: int
    slots: list[int]
    planes: "Planes | None"
    parent: "BlockHash | None" = None


