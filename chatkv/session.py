"""The session layer: one :class:`Session` per open conversation, owned by the
engine's :class:`SessionManager`.

A session owns a conversation's history, its lease in the store, its
:class:`~chatkv.tiers.TieredKV` (whose blocks the engine's loop owns), its
last save and its restore. :class:`chatkv.Chat` is a thin handle over one:
several handles on one id share the session, counted, and the last one to
close saves it and lets go of its KV and lease.

A turn, whatever started it (``send``, ``append``, ``regenerate``, ``edit``):

1. templates the history it will run on and checks it fits the context
   window (the one check, before any KV work);
2. asks the loop to pin the session and bring its KV up to the device
   (restoring from disk through the one restore path if that is where it is)
   and to align it to the new token ids, keeping the KV of the common prefix;
3. runs the turn through the scheduler (generation, or prefill only);
4. makes the new history the session's, saves the history (rewriting the
   stored one when the turn replaced part of it) and the KV the turn
   computed, and unpins the session.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chatkv.block_pool import Alignment
from chatkv.sequence import Shift
from chatkv.config import SamplingParams, switched_off
from chatkv.errors import ChatKVWarning, ContextWindowExceededError, InvalidMessageError, InvalidSessionIdError, SessionBusyError
from chatkv.persistence import KVPersister, SavedKV, Snapshot, saved_from
from chatkv.stats import RestoreInfo, TurnStats
from chatkv.storage import LeaseLostError, NewMessage, StorageError
from chatkv.tiers import Tier, TieredKV

if TYPE_CHECKING:
    from chatkv.engine import Engine
    from chatkv.storage import Lease, SessionInfo, Store, StoredKV

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
#: What a turn does when the history outgrows the context window: ``error``
#: raises ContextWindowExceededError; ``trim`` leaves the oldest whole turns
#: after the system prompt out of the window (the history keeps them) until the
#: turn and its reply budget fit in half the window, so the kept turns are
#: prefilled once and then reused, as is the system prompt's KV; ``sink``
#: (StreamingLLM, llama.cpp's context shift) keeps the first tokens (the sink)
#: and the most recent window in the cache, dropping the oldest tokens after the
#: sink in whole blocks and shifting the kept keys' rotary positions in place
#: (:mod:`chatkv.rope`), so nothing is re-prefilled (see :class:`SinkPolicy`).
CONTEXT_POLICIES = ("error", "trim", "sink")
#: Tokens per KV chunk file of a stored session, unless ``Chat(chunk_tokens=...)`` says otherwise.
DEFAULT_CHUNK_TOKENS = 256
#: ``CHATKV_REHEARSAL=0`` turns off the warm-up's rehearsal (:meth:`SessionManager.rehearse`).
REHEARSAL_ENV = "CHATKV_REHEARSAL"
#: Returning turns the rehearsal runs, each reopened from disk. A fresh
#: process's first turn over 1.8k tokens took 1.10x to 1.18x the median of its
#: next three without a rehearsal, 1.05x to 1.11x with one (medians over six
#: to ten processes per probe; the VM's noise is about as large).
REHEARSAL_TURNS = 3
#: History tokens of the rehearsal's session: four chunk files and a tail,
#: past the position from which a CPU turn's rows attend by products
#: (``chatkv.attention.torch_backend.PRODUCTS_FROM_POSITION``), as a long
#: conversation's do.
REHEARSAL_HISTORY_TOKENS = 4 * DEFAULT_CHUNK_TOKENS + 96


@dataclass(frozen=True)
class SinkPolicy:
    """Sizes of the ``sink`` context policy.

    Attributes:
        sink_tokens: tokens at the start of the conversation that always stay
            in the cache (rounded up to whole KV blocks).
        window_tokens: when a turn and its reply budget would not fit, the
            oldest tokens after the sink are dropped until the sink, the kept
            recent tokens and the reply budget take at most ``sink + window``
            tokens; None: half the context window (so a drop is followed by
            several turns without one). Never below what the new turn needs.
    """

    sink_tokens: int = 4
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        from chatkv.errors import ConfigError

        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ConfigError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if self.window_tokens is not None and (not isinstance(self.window_tokens, int) or self.window_tokens < 1):
            raise ConfigError(f"sink_window must be a positive int or None, got {self.window_tokens!r}")


def rope_shift(engine: "Engine"):  # -> chatkv.rope.RopeShift
    """The exact key shift of ``engine``'s model, computed once per model.

    Raises:
        ConfigError: the model's positions cannot be shifted exactly (see :func:`chatkv.rope.rope_shift_for`).
    """
    from chatkv.rope import rope_shift_for

    extra = engine.loaded.extra
    if "rope_shift" not in extra:
        extra["rope_shift"] = rope_shift_for(engine.loaded.model)
    return extra["rope_shift"]


@dataclass
class Message:
    """One message of the history. ``partial`` marks a reply cut short (Ctrl-C);
    ``outside`` one the window no longer holds (see :data:`CONTEXT_POLICIES`)."""

    role: str
    content: str
    partial: bool = False
    #: Left out of the model's window by ``context_policy="trim"`` (kept in the history).
    outside: bool = False

    def as_dict(self) -> dict[str, str]:
        """``{"role": ..., "content": ...}`` as chat templates expect."""
        return {"role": self.role, "content": self.content}

    @classmethod
    def parse(cls, m: "dict[str, str] | Message") -> "Message":
        """A message from a ``{"role", "content"}`` dict (or a copy of a Message).

        Raises:
            InvalidMessageError: not a dict with a known role and string content.
        """
        if isinstance(m, Message):
            m = {"role": m.role, "content": m.content}
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InvalidMessageError(f"not a message: {m!r} (want {{'role': one of {ROLES}, 'content': str}})")
        return cls(m["role"], m["content"])


def _same(a: Message, b: Message) -> bool:
    return a.role == b.role and a.content == b.content and a.partial == b.partial and a.outside == b.outside


def _common(a: list[Message], b: list[Message]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and _same(a[i], b[i]):
        i += 1
    return i


def _prefix_of(snap: Snapshot, saved: SavedKV) -> bool:
    """Whether the KV ``snap`` would write is a prefix of what the store
    already holds (``saved``), in the same window: shorter, or the same tokens
    (a session restored and closed without a turn)."""
    n = len(snap.token_ids)
    return snap.shift == saved.shift and n <= len(saved.token_ids) and saved.token_ids[:n] == snap.token_ids


def _log_failure(future: "Future[object]") -> None:
    """Log the exception of a job nobody waits for."""
    exc = future.exception()
    if exc is not None:
        log.error("a background session job failed", exc_info=exc)


#: Persistent sessions open in this process, by (store, id): one in-memory state per id.
_OPEN: dict[tuple[int, str], "Session"] = {}
_OPEN_LOCK = threading.Lock()


class Session:
    """One open conversation: history, lease, KV, saves and restores.

    Thread-safety: ``lock`` serialises turns and history changes (one at a
    time per session); ``kv`` belongs to the engine's loop and is only
    changed through :meth:`Engine.call`.

    Attributes:
        session_id: the id.
        engine: the engine whose pool holds its KV.
        kv: its KV as the tier policy sees it.
        store, persister: where it persists (None for an in-process session).
        messages: the history (the source of truth; KV is a cache of it).
        saved: what the last successful KV save wrote.
        restore: how it came back when it was opened.
        ready: set once the background restore (if any) has finished.
        handles: how many :class:`~chatkv.Chat` objects use it.
    """

    def __init__(self, manager: "SessionManager", session_id: str, store: "Store | None",
                 chunk_tokens: int) -> None:
        """An empty session (the manager opens it)."""
        self.manager = manager
        self.engine = manager.engine
        self.session_id = session_id
        self.store = store
        self.persister = KVPersister(self.engine, store, chunk_tokens) if store is not None else None
        self.kv = TieredKV(session_id, persistent=store is not None)
        self.messages: list[Message] = []
        self._stored: list[Message] = []  # what the store holds, as far as this process knows
        self.saved = SavedKV()
        self.restore = RestoreInfo("new")
        self.ready = threading.Event()
        self.opened = threading.Event()
        self.open_error: BaseException | None = None
        self.released = threading.Event()  # set once a closed session let go of its KV and lease
        self.policy = "trim"  # the context policy of the last turn (how its KV maps to the history)
        #: The session's lease in :attr:`store` (None for an in-process session):
        #: every write is fenced by it; once lost, every turn and save raises LeaseLostError.
        self.lease: "Lease | None" = None
        self.lock = threading.Lock()
        self._mu = threading.Lock()
        self._in_turn = False
        self.handles = 0
        self.closed = False

    def begin_turn(self) -> None:
        """Claim the session for one turn or history change (release with
        :meth:`end_turn`): waits for maintenance that holds :attr:`lock`, but
        refuses a second turn at once.

        Raises:
            SessionBusyError: a turn is already in flight on this session.
            LeaseLostError: this process lost the session's lease (another
                owner took it over): nothing more is done or written here.
        """
        with self._mu:
            if self._in_turn:
                raise SessionBusyError(f"session {self.session_id!r} already has a turn in flight")
            self._in_turn = True
        self.lock.acquire()
        try:
            self.check_lease()
        except BaseException:
            self.end_turn()
            raise

    def check_lease(self) -> None:
        """Make sure this process still holds the session's lease (a no-op
        without a store): cheap while renewal keeps up, a renewal now when it
        is overdue (see :meth:`chatkv.storage.Lease.ensure`).

        Raises:
            LeaseLostError: the lease was taken over; the session is lost here.
        """
        if self.lease is not None:
            self.lease.ensure()

    @property
    def lease_lost(self) -> bool:
        """True once this process found the session's lease taken over by another owner."""
        return self.lease is not None and self.lease.lost

    def end_turn(self) -> None:
        """Release what :meth:`begin_turn` claimed."""
        self.lock.release()
        with self._mu:
            self._in_turn = False

    # -- the loop's side (run through engine.call) -------------------------------------

    def _prepare(self) -> Tier:
        self.kv.pins += 1
        return self.engine.tiers.promote(self.kv)

    def _align(self, ids: list[int]) -> Alignment:
        return self.engine.pool.align(self.kv.seq, ids)

    def _align_sink(self, stream: list[int], protect: int, reserve: int, generate: bool,
                    sink: SinkPolicy) -> tuple[Alignment, int]:
        """On the loop: align the KV to ``stream`` (the whole conversation's
        ids) under the sink policy; returns the alignment and how many tokens
        this turn dropped. The KV holds ``stream[:sink] + stream[sink + dropped:]``
        (:class:`~chatkv.sequence.Shift`); when that plus ``reserve`` would not
        fit the window, the oldest cached tokens after the sink are dropped in
        whole blocks and the kept keys rotated down in place, so nothing is
        recomputed. The last ``protect`` tokens (the new turn) are never dropped.

        Raises:
            ContextWindowExceededError: the new turn alone does not fit (nothing changed).
        """
        from chatkv.rope import shift_blocks

        engine, pool, seq = self.engine, self.engine.pool, self.kv.seq
        bs = pool.block_size
        rope = rope_shift(engine)
        limit = engine.max_context - (1 if generate else 0)
        reserve = min(reserve, limit // 4)
        shift = seq.shift
        if shift is not None and len(stream) - protect < shift.sink + shift.dropped:
            # The history no longer reaches past what was dropped (a rewind, an edit,
            # a reset): the window starts again from the sink, which is still valid.
            pool.truncate(seq, min(seq.num_computed, shift.sink))
            del seq.token_ids[seq.num_computed:]
            seq.shift = shift = None
        if shift is not None:
            sunk = 0
            while sunk < min(shift.sink, seq.num_computed, len(stream)) and seq.token_ids[sunk] == stream[sunk]:
                sunk += 1
            if sunk < min(shift.sink, seq.num_computed):
                # The sink itself changed (a new system prompt): what was kept after it
                # attended to the old one, so the window starts again from the common prefix.
                pool.truncate(seq, sunk)
                del seq.token_ids[seq.num_computed:]
                seq.shift = shift = None
        s = shift.sink if shift is not None else -(-sink.sink_tokens // bs) * bs
        d = shift.dropped if shift is not None else 0
        view = stream[:s] + stream[s + d:] if d else list(stream)
        if len(view) + reserve <= limit:
            return pool.align(seq, view), 0
        goal = min(limit, s + sink.window_tokens) if sink.window_tokens is not None else limit // 2
        least = -(-(len(view) + reserve - limit) // bs) * bs
        most = (len(view) - protect - s) // bs * bs
        e = max(least, min(-(-(len(view) + reserve - goal) // bs) * bs, most))
        if e > most or e <= 0:
            raise ContextWindowExceededError(
                f"the last turn does not fit the context window of {engine.max_context} tokens with the "
                f"{s}-token sink and {reserve} tokens for the reply")
        cached = seq.num_computed
        c = 0
        limit_c = min(cached, len(view))
        while c < limit_c and seq.token_ids[c] == view[c]:
            c += 1
        h = hashlib.sha256(shift.key if shift is not None else b"")
        h.update(s.to_bytes(8, "little"))
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in view[s:s + e]))
        new = Shift(s, d + e, h.digest()[:8])  # 64 bits: the tag fits kv_format (64 characters)
        if c >= s + e:
            pool.drop_and_shift(seq, s, e, new, lambda kv, blocks, n: shift_blocks(kv, blocks, n, rope))
        else:  # what would be dropped is not all cached (lost KV, a new session): keep the sink, recompute the rest
            keep = min(c, s, cached)
            if keep < cached:
                pool.truncate(seq, keep)
            del seq.token_ids[seq.num_computed:]
            seq.shift = new
        log.info("session %s: the sink policy dropped %d tokens from the window (%d in all)",
                 self.session_id, e, new.dropped)
        return pool.align(seq, view[:s] + view[s + e:]), e

    def _mark_dropped(self, history: list[Message], shift: Shift) -> list[Message]:
        """``history`` with the messages whose every token was dropped by the
        sink policy (they lie in ``[sink, sink + dropped)`` of the stream) marked
        ``outside``. Message ends are found by bisection, a few encodings."""
        lo, hi = shift.sink, shift.sink + shift.dropped
        encode = self.engine.encode_chat
        ends: dict[int, int] = {}

        def end(i: int) -> int:  # tokens of history[:i + 1]
            if i not in ends:
                ends[i] = len(encode([m.as_dict() for m in history[: i + 1]], add_generation_prompt=False))
            return ends[i]

        def first_true(pred, a: int, b: int) -> int:  # smallest i in [a, b) with pred(i), else b
            while a < b:
                mid = (a + b) // 2
                if pred(mid):
                    b = mid
                else:
                    a = mid + 1
            return a

        n = len(history)
        first = first_true(lambda i: (end(i - 1) if i else 0) >= lo, 0, n)  # first message starting at or after lo
        stop = first_true(lambda i: end(i) > hi, first, n)  # first message ending past hi
        return [dataclasses.replace(m, outside=True) if first <= i < stop else m for i, m in enumerate(history)]

    def _unpin(self) -> None:
        self.kv.pins -= 1
        self.kv.last_used = time.monotonic()
        self.engine.tiers.enforce_budgets()

    def unpin_later(self) -> None:
        """Unpin the session on the loop without waiting for it."""
        future = self.engine.scheduler.submit_job(self._unpin, "unpin")
        future.add_done_callback(_log_failure)

    # -- turns -----------------------------------------------------------------------

    def _ids(self, history: list[Message], generate: bool, reserve: int = 0,
             policy: str = "error") -> tuple[list[int], list[Message], int]:
        """The token ids the model sees for ``history`` and the history with the
        window marked: ``(ids, history, messages newly left out)``. The one
        context-window check, before any KV work."""
        engine = self.engine
        if policy == "sink":  # the whole stream: the KV holds its sink and recent window (see _align_sink)
            return engine.encode_chat([m.as_dict() for m in history], add_generation_prompt=generate), history, 0
        sys_n = 1 if history and history[0].role == "system" else 0
        start = sys_n
        while start < len(history) and history[start].outside:
            start += 1

        def encode(first: int) -> list[int]:
            kept = history[:sys_n] + history[first:]
            return engine.encode_chat([m.as_dict() for m in kept], add_generation_prompt=generate)

        ids = encode(start)
        limit = engine.max_context - (1 if generate else 0)
        reserve = min(reserve, limit // 4)
        if policy != "trim" or len(ids) + reserve <= limit:
            engine.check_context(len(ids), generate=generate, what="the conversation")
            return ids, history, 0
        fits: tuple[int, list[int]] | None = None
        for first in (i for i in range(start + 1, len(history)) if history[i].role == "user"):
            cand = encode(first)
            if len(cand) + reserve <= limit:
                fits = fits or (first, cand)
                if len(cand) + reserve <= limit // 2:  # room for several more turns before the next trim
                    fits = (first, cand)
                    break
        if fits is None:
            raise ContextWindowExceededError(
                f"the last turn alone does not fit the context window of {engine.max_context} tokens "
                f"with {reserve} tokens for the reply")
        first, ids = fits
        marked = [dataclasses.replace(m, outside=True) if sys_n <= i < first else m for i, m in enumerate(history)]
        log.info("session %s: %d messages left the context window", self.session_id, first - start)
        return ids, marked, first - start

    def _bring_up(self, ids: list[int] | None, stats: TurnStats,
                  sink: tuple[int, int, bool, SinkPolicy] | None = None) -> None:
        """Pin, promote (restoring from disk if needed) and align to ``ids`` (if
        given; under the sink policy ``sink`` is ``(protect, reserve, generate,
        sizes)`` of :meth:`_align_sink`). Waits for the restore begun at open
        first (a turn templates its history meanwhile). The session stays
        pinned when this returns normally or raises."""
        engine = self.engine
        self.ready.wait()
        source = engine.call(self._prepare, "prepare turn")
        stats.kv_source = source
        lost = self.kv.lost
        if self.kv.tier is Tier.DISK:
            info = RestoreInfo("disk")
            if self.persister is not None:
                self.saved = self.persister.restore(self.kv, info) or SavedKV()
            else:
                engine.call(lambda: engine.tiers.restored(self.kv), "restored")
            lost = info.warning or self.kv.lost
        if ids is None:
            return
        if sink is None:
            align = engine.call(lambda: self._align(ids), "align")
        else:
            align, stats.shifted_tokens = engine.call(lambda: self._align_sink(ids, *sink), "align")
            ids = self.kv.seq.token_ids
        stats.prompt_tokens = len(ids)
        stats.reused_tokens = align.kept
        stats.prefix_cache_tokens = align.prefix_cache
        stats.discarded_tokens = align.discarded
        if align.discarded:
            stats.not_reused = f"the history diverged from the cached tokens at token {align.kept}"
        elif lost and align.kept < len(ids) - 1:
            stats.not_reused = lost
        self.kv.lost = None

    def turn(self, history: list[Message], params: SamplingParams, stats: TurnStats,
             policy: str = "trim", sink: SinkPolicy | None = None) -> Iterator[str]:
        """Run a generating turn on ``history`` (ending with the user message),
        yielding the reply's pieces; ``policy`` (see :data:`CONTEXT_POLICIES`)
        says what happens when it outgrows the window. When it ends with at least one token, the
        history becomes ``history`` plus the reply (``partial`` if interrupted)
        and is saved; otherwise nothing changes. The caller holds :attr:`lock`."""
        ids, history, stats.trimmed_messages = self._ids(history, True, params.max_new_tokens, policy)
        self.policy = policy
        try:
            self._bring_up(ids, stats, self._sink_args(history, ids, params.max_new_tokens, True, policy, sink))
            history = self._after_shift(history, stats)
            failed = False
            try:
                yield from self.engine.generate(self.kv.seq, params, stats)
            except (KeyboardInterrupt, GeneratorExit):
                raise  # the user stopped it: what was generated is kept, marked partial
            except BaseException:
                failed = True  # the turn failed (pool, queue, a bug): the history stays as it was
                raise
            finally:
                if stats.token_ids and not failed:
                    partial = stats.finish_reason == "interrupted"
                    self.messages = list(history) + [Message("assistant", stats.text, partial=partial)]
                self.persist(stats)
        finally:
            self.unpin_later()
            stats.total_s = time.perf_counter() - (stats.started_at or time.perf_counter())

    def prefill(self, history: list[Message], stats: TurnStats, policy: str = "trim",
                sink: SinkPolicy | None = None, new_messages: int = 1) -> None:
        """Teacher-force ``history`` into the KV without generating, make it the
        session's history and save it; its last ``new_messages`` are new (the
        sink policy never drops them). The caller holds :attr:`lock`."""
        ids, history, stats.trimmed_messages = self._ids(history, False, 0, policy)
        self.policy = policy
        try:
            self._bring_up(ids, stats, self._sink_args(history, ids, 0, False, policy, sink, new_messages))
            history = self._after_shift(history, stats)
            stats.prefilled_tokens = self.engine.prefill(self.kv.seq, stats)
            self.messages = list(history)
            self.persist(stats)
        finally:
            self.unpin_later()
            stats.total_s = time.perf_counter() - (stats.started_at or time.perf_counter())

    def _sink_args(self, history: list[Message], ids: list[int], reserve: int, generate: bool, policy: str,
                   sink: SinkPolicy | None, new_messages: int = 1) -> tuple[int, int, bool, SinkPolicy] | None:
        """The sink policy's arguments for :meth:`_bring_up` (None under another
        policy): the last ``new_messages`` of ``history`` are protected from drops."""
        if policy != "sink":
            return None
        old = history[: max(len(history) - max(new_messages, 1), 0)]
        before = self.engine.encode_chat([m.as_dict() for m in old], add_generation_prompt=False) if old else []
        protect = len(ids) - len(before) if ids[: len(before)] == before else len(ids)
        return max(protect, 1), reserve, generate, sink or SinkPolicy()

    def _after_shift(self, history: list[Message], stats: TurnStats) -> list[Message]:
        """After a turn's sink drop, ``history`` with the dropped messages marked ``outside``."""
        shift = self.kv.seq.shift
        if not stats.shifted_tokens or shift is None:
            return history
        marked = self._mark_dropped(history, shift)
        stats.trimmed_messages = sum(m.outside and not o.outside for m, o in zip(marked, history))
        return marked

    def set_history(self, messages: list[Message]) -> None:
        """Replace the history (a rewind, a new system prompt, a reset) and save it.
        KV on the device past what the new history shares with it is released at
        once, in the pool and on disk, so no unreachable KV stays behind. The
        caller holds :attr:`lock`."""
        self.messages = list(messages)
        if messages:
            sink = self.policy == "sink"  # its KV holds a view of the whole stream
            kept = [m for i, m in enumerate(messages) if sink or not (m.outside and i)]
            ids = self.engine.encode_chat([m.as_dict() for m in kept], add_generation_prompt=False)

            def trim() -> None:
                if self.kv.tier is Tier.DEVICE and not self.kv.pins:
                    seq, view = self.kv.seq, ids
                    shift = seq.shift
                    if shift is not None and len(ids) <= shift.sink + shift.dropped:
                        self.engine.pool.truncate(seq, min(seq.num_computed, shift.sink))
                        seq.shift = None  # the sink's KV is the stream's own
                    elif shift is not None:
                        view = ids[: shift.sink] + ids[shift.sink + shift.dropped:]
                    self.engine.pool.trim_to(seq, view)
            self.engine.call(trim, "trim dead KV")
        self.persist(shrink=True)

    def set_retention(self, pin: bool | None = None, ttl_s: float | None | object = ...) -> None:
        """Keep the session's KV on the device however long it idles (``pin``;
        None: unchanged) and/or give it its own KV TTL in idle seconds
        (``ttl_s``; left out: unchanged; None: the engine's and store's TTL
        again). Both hold for the tier policy now and, for a stored session,
        are saved with it, so gc and later processes honour them.

        Raises:
            ValueError: a negative TTL. StorageError: the store failed (nothing changed).
        """
        if ttl_s is not ... and ttl_s is not None:
            ttl_s = float(ttl_s)  # type: ignore[arg-type]
            if not ttl_s >= 0:
                raise ValueError(f"ttl must be >= 0 seconds or None, not {ttl_s!r}")
        if pin is None and ttl_s is ...:
            return
        if self.store is not None:
            self.store.set_retention(self.session_id, pinned=pin, kv_ttl_s=ttl_s)
        kv = self.kv

        def apply() -> None:
            if pin is not None:
                kv.keep_resident = bool(pin)
            if ttl_s is not ...:
                kv.kv_ttl_s = ttl_s  # type: ignore[assignment]
        self.engine.call(apply, "retention")

    def forget_kv(self) -> None:
        """Release every bit of KV the session holds in memory (it keeps its tier entry)."""
        def drop() -> None:
            kv = self.kv
            self.engine.pool.release(kv.seq)
            kv.offloaded = None
            kv.tier = Tier.DEVICE
        self.engine.call(drop, "forget KV")

    # -- saving ----------------------------------------------------------------------

    def persist(self, stats: TurnStats | None = None, *, shrink: bool = False) -> None:
        """Save what the store lacks: the history (rewritten from the first
        message that differs, in one transaction), then the KV chunks, if the
        KV is on the device. A device KV that is only a prefix of the stored
        one (a restore that chose to recompute, or that the pool could hold
        only part of, and no turn since) leaves the stored KV as it is:
        writing it would throw away KV that is still valid; so does one of
        the same tokens (restored, no turn since), which would only write
        the last, partial chunk again. With ``shrink`` (a
        rewritten history) it is written, so the stored KV past the new
        history goes too. Storage failures warn and leave the in-memory
        conversation intact (the next save retries). The caller holds :attr:`lock`.

        Raises:
            LeaseLostError: the lease was lost: nothing was written, and nothing
                will be from this process (never a silent interleaving with
                the new holder's writes).
        """
        store, persister = self.store, self.persister
        if store is None or persister is None:
            return
        try:
            self._save_history(store)
            snap = self.engine.call(
                lambda: persister.snapshot(self.kv.seq, self.saved) if self.kv.tier is Tier.DEVICE else None,
                "snapshot")
            if snap is not None and not shrink and _prefix_of(snap, self.saved):
                snap = None  # the store holds all of it and more
            if snap is not None:
                self.saved, result = persister.write(self.session_id, snap)
                self.kv.disk_bytes = sum(c.bytes for c in self.saved.chunks)
                if stats is not None:
                    stats.bytes_written = result.bytes_written
        except LeaseLostError:
            raise
        except StorageError as exc:
            message = f"could not save session {self.session_id!r}: {exc}; the conversation continues in memory"
            if stats is not None:
                stats.persist_error = message
            log.warning("%s", message)
            warnings.warn(message, ChatKVWarning, stacklevel=4)

    def _save_history(self, store: "Store") -> None:
        keep = _common(self._stored, self.messages)
        rest = self.messages[keep:]
        if keep == len(self._stored) and not rest:
            return
        rows = [(m.role, m.content, None, m.partial, m.outside) for m in rest]
        # Always "keep the first `keep`, then these", never a bare append: if a
        # commit's outcome was unknown (the connection cut during COMMIT, the
        # database restarted), _stored was not advanced and the next save
        # writes the same rows over whatever that commit left, never twice.
        store.rewrite_history(self.session_id, keep, rows)
        self._stored = [dataclasses.replace(m) for m in self.messages]

    def drop_stored_kv(self) -> None:
        """After the tier policy expired the session, drop its stored KV too
        (unless a turn brought it back meanwhile)."""
        with self.lock:
            if self.kv.tier is not Tier.EXPIRED or self.store is None:
                return
            try:
                self.store.invalidate_kv(self.session_id)
            except StorageError as exc:
                log.warning("session %s: could not expire its stored KV: %s", self.session_id, exc)
                return
            self.saved = SavedKV()
            self.kv.disk_bytes = 0


class SessionManager:
    """Opens, shares, forks, maintains and closes the sessions of one engine."""

    def __init__(self, engine: "Engine") -> None:
        """A manager for ``engine``'s sessions (none open yet)."""
        self.engine = engine
        self._mu = threading.Lock()
        self._local: dict[str, Session] = {}  # in-process sessions (no store), kept after close
        self._stores: dict[int, "Store"] = {}
        self._maint_stop: threading.Event | None = None
        self._last_store_gc = time.monotonic()
        self._opens = 0  # calls of open(), for the rehearsal to notice another session's
        self.start_maintenance()

    # -- open and close ------------------------------------------------------------------

    def open(self, session_id: str, *, store: "Store | None", chunk_tokens: int,
             lease_timeout_s: float = 0.0, system: str | None = None) -> Session:
        """The session ``session_id``, opened (or shared, if already open in this
        process) with one more handle. With a ``store``, a new one is created,
        an existing one's history is loaded and its KV restored in the
        background (:attr:`Session.ready`), and its lease is taken.

        Raises:
            SessionBusyError: the id is open in this process on another engine.
            SessionLockedError: another process holds it.
            StorageError: the store failed.
        """
        with self._mu:
            self._opens += 1
        if store is None:
            with self._mu:
                session = self._local.get(session_id)
                if session is None:
                    session = self._local[session_id] = Session(self, session_id, None, chunk_tokens)
                    self.engine.call(lambda: self.engine.tiers.register(session.kv), "register")
                    session.opened.set()
                    session.ready.set()
                elif session.ready.is_set():
                    session.restore = RestoreInfo("memory", turns=self._turns(session),
                                                  cached_tokens=session.kv.seq.num_computed)
                session.handles += 1
            return session
        key = (id(store), session_id)
        while True:  # a session still closing in this process is waited for, then reopened
            with _OPEN_LOCK:
                session = _OPEN.get(key)
                if session is None or not session.closed:
                    creating = session is None
                    if creating:
                        session = _OPEN[key] = Session(self, session_id, store, chunk_tokens)
                    elif session.engine is not self.engine:
                        raise SessionBusyError(
                            f"session {session_id!r} is already open in this process on another engine "
                            f"(model {session.engine.loaded.name!r}); close it there first")
                    session.handles += 1
                    break
            session.released.wait()
        if not creating:
            session.opened.wait()
            if session.open_error is not None:
                raise session.open_error
            if session.ready.is_set():
                session.restore = RestoreInfo("memory", turns=self._turns(session),
                                              cached_tokens=session.kv.seq.num_computed)
            return session
        try:
            self._open_stored(session, store, lease_timeout_s, system)
        except BaseException as exc:
            session.open_error = exc
            with _OPEN_LOCK:
                _OPEN.pop(key, None)
            session.opened.set()
            raise
        session.opened.set()
        return session

    @staticmethod
    def _turns(session: Session) -> int:
        return sum(m.role == "user" for m in session.messages)

    def _open_stored(self, session: Session, store: "Store", lease_timeout_s: float,
                     system: str | None) -> None:
        engine, sid = self.engine, session.session_id

        def waiting(holder: str) -> None:
            log.info("session %r is in use by %s; waiting up to %.1f s for its lease", sid, holder, lease_timeout_s)

        # The lease, and in its transaction what the previous holder committed:
        # the session's row, its messages and its chunk list (read here, where the
        # restore would share the GIL with the turn).
        opened = store.open_leased(sid, fingerprint=engine.loaded.fingerprint, system_prompt=system,
                                   timeout_s=lease_timeout_s, on_wait=waiting)
        session.lease = opened.lease
        try:
            info, records, stored = opened.info, opened.messages, opened.kv
            session.messages = [Message(r.role, r.content, r.partial, r.outside_window) for r in records]
            session._stored = [dataclasses.replace(m) for m in session.messages]
            n_cached = info.n_cached
            session.restore = RestoreInfo("history" if records or n_cached else "new", turns=self._turns(session))
            kv = session.kv
            kv.tier = Tier.DISK if n_cached else Tier.DEVICE
            kv.disk_bytes = info.kv_bytes
            kv.keep_resident, kv.kv_ttl_s = info.pinned, info.kv_ttl_s  # retention stored with the session
            kv.pins = 1 if n_cached else 0
            engine.call(lambda: engine.tiers.register(kv), "register")
        except BaseException:
            store.release_lease(sid)
            raise
        with self._mu:
            self._stores[id(store)] = store
        if not n_cached:
            session.ready.set()
            return
        threading.Thread(target=self._restore_at_open, args=(session, info, stored),
                         name=f"chatkv-restore-{sid}", daemon=True).start()

    def _restore_at_open(self, session: Session, facts: "SessionInfo", stored: "StoredKV | None" = None) -> None:
        info = session.restore
        try:
            saved = session.persister.restore(session.kv, info, need_room=True,  # type: ignore[union-attr]
                                              session=facts, stored=stored)
            if saved is not None:
                session.saved = saved
        except Exception as exc:  # a storage failure costs a re-prefill, never the session
            info.warning = f"could not load the KV of session {session.session_id!r}: {exc}; re-prefilling"
            log.warning("%s", info.warning)
            # What the open read is still what is on disk: a close before the
            # turn must not cut it to the part the device holds.
            session.saved = saved_from(stored) if stored is not None else SavedKV()
        finally:
            info.cached_tokens = session.kv.seq.num_computed
            if info.cached_tokens:
                info.source = "disk"
            session.unpin_later()
            session.ready.set()
        if info.warning:
            warnings.warn(info.warning, ChatKVWarning, stacklevel=2)

    def close(self, session: Session) -> None:
        """Drop one handle; the last one saves the session and releases its KV (and,
        for a stored session, its lease and its place in memory)."""
        with _OPEN_LOCK if session.store is not None else self._mu:
            session.handles -= 1
            last = session.handles == 0
            if last and session.store is not None:
                session.closed = True  # new opens of the id wait for `released`, then start afresh
        if not last:
            return
        try:
            session.ready.wait()
            with session.lock:
                try:
                    session.persist()
                except LeaseLostError as exc:  # the new holder's history stands; this one's last changes go
                    log.warning("session %r closed without saving: %s", session.session_id, exc)
                if session.store is None:
                    session.forget_kv()
                    return
                self.engine.call(lambda: self.engine.tiers.unregister(session.kv), "unregister")
                session.store.release_lease(session.session_id)
        finally:
            if session.store is not None:
                with _OPEN_LOCK:
                    if _OPEN.get((id(session.store), session.session_id)) is session:
                        del _OPEN[(id(session.store), session.session_id)]
                session.released.set()

    def close_all(self) -> None:
        """Close every session open on this engine, whatever handles remain (for
        :meth:`chatkv.engine.Engine.close`): each is saved and let go as its
        last handle would. A failure to close one is logged, not raised."""
        for session in self._all():
            session.handles = 1
            try:
                self.close(session)
            except Exception:
                log.exception("could not close session %r while closing its engine", session.session_id)
        with self._mu:
            self._local.clear()

    def fork(self, parent: Session, session_id: str) -> Session:
        """A new session (one handle) that starts as a copy of ``parent``, sharing
        its KV blocks copy-on-write and, on disk, its chunks.

        Raises:
            InvalidSessionIdError: ``session_id`` is already used.
        """
        engine, store = self.engine, parent.store
        with _OPEN_LOCK, self._mu:
            taken = session_id in self._local or (store is not None and (id(store), session_id) in _OPEN)
        if taken or (store is not None and store.has_session(session_id)):
            raise InvalidSessionIdError(f"session {session_id!r} already exists")
        parent.ready.wait()
        parent.begin_turn()
        try:
            parent._bring_up(None, TurnStats())  # pinned until the child shares its blocks
            chunk_tokens = parent.persister.chunk_tokens if parent.persister else 256
            if store is not None:  # the child's row and whole history in one transaction: a fork is whole or absent
                msgs = parent.messages
                store.create_session(
                    session_id, fingerprint=engine.loaded.fingerprint,
                    system_prompt=msgs[0].content if msgs and msgs[0].role == "system" else None,
                    messages=[NewMessage(m.role, m.content, None, m.partial, None, m.outside) for m in msgs])
            child = self.open(session_id, store=store, chunk_tokens=chunk_tokens)
            with child.lock:
                def share() -> None:
                    engine.pool.release(child.kv.seq)
                    child.kv.seq = engine.pool.fork(parent.kv.seq)
                    child.kv.tier = Tier.DEVICE
                engine.call(share, "fork")
                child.messages = [dataclasses.replace(m) for m in parent.messages]
                child.persist()
        finally:
            parent.unpin_later()
            parent.end_turn()
        return child

    # -- tiers ----------------------------------------------------------------------

    def _all(self) -> list[Session]:
        with _OPEN_LOCK, self._mu:
            stored = [s for s in _OPEN.values() if s.engine is self.engine]
            return stored + list(self._local.values())

    def get(self, session_id: str) -> Session | None:
        """The session ``session_id`` open (not still opening) on this engine, if any."""
        for s in self._all():
            if s.session_id == session_id and s.opened.is_set() and s.open_error is None:
                return s
        return None

    def demote(self, session_id: str, tier: Tier | str) -> bool:
        """Move an idle open session down to ``tier`` now (see
        :meth:`chatkv.tiers.TierManager.demote`); False if it is busy or not above it."""
        session = self.get(session_id)
        if session is None:
            raise KeyError(session_id)

        def move() -> bool:
            tiers = self.engine.tiers
            return tiers.get(session_id) is session.kv and tiers.demote(session.kv, tier)

        moved = self.engine.call(move, "demote")
        if moved and session.kv.tier is Tier.EXPIRED:
            session.drop_stored_kv()
        return moved

    def maintain(self, now: float | None = None, store_gc: bool | None = None) -> None:
        """One maintenance pass: the tier policies (idle times, budgets) on the
        loop; the stored KV of sessions that expired is dropped; and, every
        ``store_gc_interval_s`` (or when ``store_gc`` is True), the disk policy
        (KV TTL, disk budget, orphan files) on every store this engine's
        sessions use, skipping the sessions open here (their policy ran above)."""
        expired = self.engine.call(lambda: self.engine.tiers.maintain(now), "maintain")
        by_kv = {id(s.kv): s for s in self._all()}
        for kv in expired:
            session = by_kv.get(id(kv))
            if session is not None:
                session.drop_stored_kv()
        config = self.engine.tiers.config
        due = config.store_gc_interval_s is not None and \
            time.monotonic() - self._last_store_gc >= config.store_gc_interval_s
        if store_gc or (store_gc is None and due):
            from chatkv.storage import DiskPolicy, enforce_disk_policy

            self._last_store_gc = time.monotonic()
            policy = DiskPolicy(kv_ttl_s=config.kv_ttl_s, disk_budget_bytes=config.disk_budget_bytes)
            with self._mu:
                stores = list(self._stores.values())
            open_ids = [s.session_id for s in self._all()]
            for store in stores:
                report = enforce_disk_policy(store, policy, skip=open_ids)
                if report.expired_sessions or report.over_budget_sessions or report.files_removed:
                    log.info("disk policy: expired %d, over budget %d, removed %d files",
                             len(report.expired_sessions), len(report.over_budget_sessions), report.files_removed)

    def rehearse(self, turns: int = REHEARSAL_TURNS) -> int:
        """The warm-up's rehearsal of a returning conversation: a throwaway
        session in a store of its own (SQLite in a temporary directory, removed
        after), prefilled with :data:`REHEARSAL_HISTORY_TOKENS` of history and
        saved, then ``turns`` times reopened, its KV read back from its chunk
        files by the restore path, and given a two-token turn, so that the
        first turn of a session in this process finds every step of that path
        run before (the index and the lease, the restore's reads, templating,
        the turn's steps and sampling, its save). Its blocks are freed after
        each turn, never kept for the prefix cache, and the counters a turn
        moves (tier hits, the pool's prefix counters, the scheduler's) are put
        back as they were. Another session comes first: none is started while
        one is open on this engine, and none after another opened meanwhile
        (the counters then stay as they are). Off with ``CHATKV_REHEARSAL=0``.

        Returns the turns run (0 when skipped). Never raises: a failure (no
        room in the pool or the window, no writable temporary directory, the
        engine closing) is logged and ends the rehearsal.
        """
        engine = self.engine
        if switched_off(REHEARSAL_ENV) or self._in_use():
            return 0
        started = time.perf_counter()
        target = min(REHEARSAL_HISTORY_TOKENS, engine.max_context // 2)
        room = engine.call(lambda: engine.pool.num_available * engine.pool.block_size, "rehearsal: room")
        if room < 2 * target:  # its history, turns and a margin: a pool this small is left to real turns
            log.debug("no rehearsal: %d free slots in the pool", room)
            return 0
        history = _rehearsal_history(engine, target)
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        with self._mu:
            opens = self._opens
        counters = engine.call(lambda: _counters(engine), "rehearsal: counters")
        ran = 0
        home = None
        store: "Store | None" = None
        try:
            from chatkv.storage import Store

            _sweep_rehearsal_homes()
            home = tempfile.mkdtemp(prefix=f"{REHEARSAL_PREFIX}{os.getpid()}-")
            _REHEARSAL_HOMES.add(home)
            store = Store(home)
            for i in range(turns + 1):
                with self._mu:
                    interrupted = self._opens != opens + i
                if interrupted or self._in_use():
                    log.debug("rehearsal stopped after %d turns: another session opened", ran)
                    return ran
                session = self.open(REHEARSAL_SESSION_ID, store=store, chunk_tokens=DEFAULT_CHUNK_TOKENS)
                try:
                    session.begin_turn()
                    try:
                        if i == 0:
                            session.prefill(history, TurnStats())
                        else:
                            user = Message("user", "Say hello.")
                            for _ in session.turn(session.messages + [user], params, TurnStats()):
                                pass
                            ran += 1
                    finally:
                        session.end_turn()
                    seq = session.kv.seq
                    engine.call(lambda: engine.pool.discard(seq), "rehearsal: free its blocks")
                finally:
                    self.close(session)
            with self._mu:
                alone = self._opens == opens + turns + 1
            if alone and not self._in_use():
                engine.call(lambda: _restore_counters(engine, counters), "rehearsal: counters back")
            log.debug("rehearsal: %d returning turns in %.2f s", ran, time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - only the first turn's speed depends on it; say why
            if engine.scheduler.closed:
                log.debug("rehearsal ended by the engine's close after %d turns", ran)
            else:
                log.warning("the warm-up's rehearsal failed after %d turns (a session's first turn pays its "
                            "first-call costs): %s", ran, exc, exc_info=True)
        finally:
            if store is not None:
                with self._mu:
                    self._stores.pop(id(store), None)
                try:
                    store.close()
                except Exception:  # noqa: BLE001 - its directory goes below anyway
                    log.warning("closing the rehearsal's store failed", exc_info=True)
            if home is not None:
                shutil.rmtree(home, ignore_errors=True)
                _REHEARSAL_HOMES.discard(home)
        return ran

    def _in_use(self) -> bool:
        """Whether a session is open on this engine (an in-process one kept after
        its close is not)."""
        return any(s.handles > 0 for s in self._all())

    def start_maintenance(self) -> None:
        """(Re)start the background maintenance thread at the configured interval
        (stopping it when there is none). Failures are logged, never swallowed."""
        if self._maint_stop is not None:
            self._maint_stop.set()
            self._maint_stop = None
        interval = self.engine.tiers.config.maintenance_interval_s
        if not interval:
            return
        stop = self._maint_stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                try:
                    self.maintain()
                except Exception:
                    log.exception("tier maintenance failed; retrying in %.1f s", interval)

        threading.Thread(target=loop, name="chatkv-maintenance", daemon=True).start()

    def stop_maintenance(self) -> None:
        """Stop the maintenance thread, if running."""
        if self._maint_stop is not None:
            self._maint_stop.set()
            self._maint_stop = None


#: The rehearsal's session id (in its own temporary store).
REHEARSAL_SESSION_ID = "chatkv-rehearsal"
#: Its store's directory in the temporary directory: this prefix, the process id, a dash.
REHEARSAL_PREFIX = "chatkv-rehearsal-"
_REHEARSAL_HOMES: set[str] = set()  # this process's rehearsal stores not removed yet


@atexit.register
def _remove_rehearsal_homes() -> None:
    """At exit: the store of a rehearsal the exit cut short (its thread is a daemon)."""
    for home in list(_REHEARSAL_HOMES):
        shutil.rmtree(home, ignore_errors=True)


def _sweep_rehearsal_homes() -> None:
    """Remove rehearsal stores this user's processes left in the temporary
    directory when they were killed (their process is gone)."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{REHEARSAL_PREFIX}*-*"):
        try:
            pid = int(path.name[len(REHEARSAL_PREFIX):].split("-", 1)[0])
            if pid == os.getpid() or path.stat().st_uid != getattr(os, "getuid", lambda: 0)():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            log.info("removing %s, the rehearsal store of a process that is gone", path)
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, OSError):  # not ours, or alive (PermissionError)
            continue


def _rehearsal_history(engine: "Engine", target: int) -> list[Message]:
    """A made-up history of whole exchanges of at least ``target`` tokens
    (fewer only where 32 exchanges do not reach it)."""
    text = "The rehearsal of a returning conversation: nothing here is ever read again. " * 6
    history: list[Message] = []
    while len(history) < 64:
        history += [Message("user", text), Message("assistant", text)]
        if len(engine.encode_chat([m.as_dict() for m in history], add_generation_prompt=False)) >= target:
            break
    return history


def _counters(engine: "Engine") -> tuple:
    """On the loop: the counters a turn moves (tier hits and misses, the
    pool's prefix and eviction counters, the scheduler's), copied by their owners."""
    return engine.tiers.counters(), engine.pool.counters(), engine.scheduler.counters()


def _restore_counters(engine: "Engine", saved: tuple) -> None:
    """On the loop: put back the counters :func:`_counters` copied, each by its owner."""
    tiers, pool, scheduler = saved
    engine.tiers.restore_counters(tiers)
    engine.pool.restore_counters(pool)
    engine.scheduler.restore_counters(scheduler)
