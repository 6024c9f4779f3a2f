"""``Chat``: a multi-turn conversation whose KV cache persists across turns,
processes and restarts."""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

from chatkv import aio
from chatkv.config import EngineConfig, SamplingParams
from chatkv.engine import Engine, GenerationResult, get_engine
from chatkv.errors import (
    ChatKVWarning,
    ContextWindowExceededError,
    InvalidMessageError,
    InvalidSessionIdError,
    SessionBusyError,
)
from chatkv.models import LoadedModel
from chatkv.persistence import KVPersister, RestoreInfo, SavedKV, default_store
from chatkv.sequence import Sequence
from chatkv.storage import StorageError, Store
from chatkv.tiers import TierConfig, tier_manager
from chatkv.storage import InvalidSessionIdError as _StorageIdError
from chatkv.storage import validate_session_id as _validate_id

DEFAULT_CHUNK_TOKENS = 256


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a safe id, else raise :class:`InvalidSessionIdError`.

    Safe: a string of 1 to 128 characters from ``[A-Za-z0-9._-]`` that does not
    start with ``.`` (so never ``..``). Ids are index keys, never paths.
    """
    try:
        return _validate_id(session_id)
    except _StorageIdError as exc:
        raise InvalidSessionIdError(str(exc)) from None


@dataclass
class Message:
    """One message of the history. ``partial`` marks a reply cut short (Ctrl-C)."""

    role: str
    content: str
    partial: bool = False

    def as_dict(self) -> dict[str, str]:
        """``{"role": ..., "content": ...}`` as chat templates expect."""
        return {"role": self.role, "content": self.content}


@dataclass
class TurnStats:
    """What one turn cost and where its KV came from.

    Attributes:
        prompt_tokens: tokens of the whole templated history plus the new turn.
        reused_tokens: of those, tokens whose KV was already cached (not recomputed).
        prefilled_tokens: tokens computed by this turn's prefill.
        discarded_tokens: cached tokens that no longer matched the template of
            the history (e.g. a reply that re-tokenizes differently) and were
            recomputed.
        prefix_cache_tokens: reused tokens found in blocks other sessions share.
        ttft_s: seconds from the call to the first token, including waiting for
            a background restore, promotion from a lower tier and templating.
        generated_tokens, finish_reason, decode_tokens_per_s, total_s: the
            generation itself.
        kv_source: the tier the session's KV was in when the turn started
            (``device``, ``quantized``, ``host``, ``disk`` or ``expired``).
        bytes_written: bytes of chunk files this turn's save wrote.
        persist_error: why the turn could not be saved (the conversation
            continues in memory), or None.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    discarded_tokens: int = 0
    prefix_cache_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    total_s: float = 0.0
    kv_source: str = "device"
    bytes_written: int = 0
    persist_error: str | None = None


@dataclass
class _Session:
    """In-process state of one session, shared by every ``Chat`` opened on it."""

    session_id: str
    messages: list[Message] = field(default_factory=list)
    seq: Sequence = field(default_factory=Sequence)
    busy: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)
    restore: RestoreInfo = field(default_factory=lambda: RestoreInfo("new"))
    store: Store | None = None
    persister: KVPersister | None = None
    saved: SavedKV = field(default_factory=SavedKV)
    persisted_messages: int = 0
    history_dirty: bool = False  # stored history must be rewritten (system prompt changed, reset)
    tier: str = "device"  # see chatkv.tiers.TIERS
    last_used: float = field(default_factory=time.monotonic)
    offloaded: Any = None  # chatkv.tiers.OffloadedKV while in the quantized or host tier


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Chat:
    """A conversation with a chat model whose KV cache persists across turns and restarts.

    ``Chat("user-42")`` opens the session ``user-42``, creating it if new. With
    ``persist=True`` (the default) its history and KV live in the store under
    ``$CHATKV_HOME``: constructing a ``Chat`` takes the session's lease (another
    process using the same id gets :class:`~chatkv.storage.SessionLockedError`)
    and starts loading its KV from disk in the background; the first turn waits
    for that. Each :meth:`send` templates the history plus the new message,
    reuses the cached KV of the longest prefix that still matches, prefills only
    the rest, generates a reply, then saves the new messages and the KV chunks
    the turn completed.

    Args:
        session_id: 1-128 characters from ``[A-Za-z0-9._-]``, not starting with ``.``.
        system: the system prompt. For an existing session, a different value
            replaces its system prompt (the KV after it is recomputed); None keeps it.
        model: a model spec (see :func:`chatkv.models.load_model`) or a
            :class:`~chatkv.models.LoadedModel`; None is the default model.
        engine: an explicit :class:`~chatkv.engine.Engine` (overrides ``model``).
        engine_config: pool settings for a new engine.
        store: where sessions persist (default: the store at ``$CHATKV_HOME``).
        persist: False keeps the session in this process only.
        chunk_tokens: tokens per chunk file (a multiple of the block size).
        lease_timeout_s: how long to wait for another process to release the session.
        tiers: budgets and idle policies of the engine's memory tiers
            (engine-wide; see :class:`~chatkv.tiers.TierConfig`).
        kv_quant: shorthand for ``tiers.quant_scheme`` (``none``, ``int8``,
            ``fp8``, ``int4``): how idle sessions are compressed (engine-wide).
        **sampling: defaults for :class:`~chatkv.config.SamplingParams`
            (``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_new_tokens``,
            ``stop``, ``ignore_eos``).

    Raises:
        InvalidSessionIdError: a bad ``session_id``.
        SessionLockedError: another process holds the session.
        ConfigError: an unknown sampling option.
        StorageError: the store cannot be opened.
    """

    def __init__(
        self,
        session_id: str,
        system: str | None = None,
        model: str | LoadedModel | None = None,
        *,
        engine: Engine | None = None,
        engine_config: EngineConfig | None = None,
        store: Store | None = None,
        persist: bool = True,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        lease_timeout_s: float = 0.0,
        tiers: TierConfig | None = None,
        kv_quant: str | None = None,
        **sampling: Any,
    ) -> None:
        self.session_id = validate_session_id(session_id)
        self.sampling = SamplingParams.from_dict(sampling)
        self.engine = engine or get_engine(model, engine_config)
        if kv_quant is not None:
            base = tiers or tier_manager(self.engine).config
            tiers = dataclasses.replace(base, quant_scheme=kv_quant)
        self.tiers = tier_manager(self.engine, tiers)
        self.last_stats: TurnStats | None = None
        #: Token ids, text and finish reason of the last turn's generation.
        self.last_generation: GenerationResult | None = None
        self._closed = False
        with self.engine.lock:
            state = self.engine.sessions.get(session_id)
            created = state is None
            if created:
                state = _Session(session_id)
                self.engine.sessions[session_id] = state
        self._state: _Session = state
        if created:
            try:
                if persist:
                    self._open_persistent(state, store or default_store(), chunk_tokens, lease_timeout_s, system)
                else:
                    state.ready.set()
            except BaseException:
                with self.engine.lock:
                    self.engine.sessions.pop(session_id, None)
                raise
        elif state.ready.is_set():
            state.restore = RestoreInfo(
                "memory", turns=sum(m.role == "user" for m in state.messages),
                cached_tokens=state.seq.num_computed,
            )
        if system is not None:
            self.set_system(system)

    def _open_persistent(self, state: _Session, store: Store, chunk_tokens: int, lease_timeout_s: float,
                         system: str | None) -> None:
        started = time.perf_counter()
        existed = store.has_session(self.session_id)
        store.open_session(self.session_id, fingerprint=self.engine.loaded.fingerprint, system_prompt=system)
        store.acquire_lease(self.session_id, timeout_s=lease_timeout_s)
        state.store = store
        state.persister = KVPersister(self.engine, store, chunk_tokens)
        records = store.messages(self.session_id)
        state.messages = [Message(r.role, r.content, r.partial) for r in records]
        state.persisted_messages = len(records)
        state.restore = RestoreInfo("history" if existed else "new",
                                    turns=sum(r.role == "user" for r in records))
        if not existed:
            state.ready.set()
            return

        session_info = store.get_session(self.session_id)
        tiers = self.tiers
        pool = self.engine.pool

        def load() -> None:
            info = state.restore
            try:
                need = -(-session_info.n_cached // pool.block_size)
                tiers.reserve(state, need)
                if pool.num_available < need:
                    state.tier = "disk"  # no room now: the first turn loads it
                    return
                state.saved = state.persister.restore(self.session_id, state.seq, info)  # type: ignore[union-attr]
            except Exception as exc:  # a storage failure costs a re-prefill, never the session
                info.warning = f"could not load the KV of session {self.session_id!r}: {exc}; re-prefilling"
                state.saved = SavedKV()
            finally:
                info.cached_tokens = state.seq.num_computed
                if info.cached_tokens:
                    info.source = "disk"
                info.seconds = time.perf_counter() - started
                state.ready.set()
            if info.warning:
                warnings.warn(info.warning, ChatKVWarning, stacklevel=2)

        threading.Thread(target=load, name=f"chatkv-restore-{self.session_id}", daemon=True).start()

    # -- restore -----------------------------------------------------------------

    def wait_restored(self, timeout: float | None = None) -> RestoreInfo:
        """Block until the session's KV is loaded (a no-op for new or resident
        sessions) and return how it came back.

        Raises:
            TimeoutError: not loaded within ``timeout`` seconds.
        """
        if not self._state.ready.wait(timeout):
            raise TimeoutError(f"session {self.session_id!r} is still loading")
        return self._state.restore

    @property
    def restore(self) -> RestoreInfo:
        """How this session came back (see :class:`~chatkv.persistence.RestoreInfo`);
        complete once :meth:`wait_restored` returns."""
        return self._state.restore

    # -- history -----------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, str]]:
        """A copy of the history as ``[{"role", "content"}, ...]``."""
        return [m.as_dict() for m in self._state.messages]

    @property
    def history(self) -> list[Message]:
        """A copy of the history with per-message flags (e.g. ``partial``)."""
        return [dataclasses.replace(m) for m in self._state.messages]

    @property
    def system(self) -> str | None:
        """The current system prompt, if any."""
        msgs = self._state.messages
        return msgs[0].content if msgs and msgs[0].role == "system" else None

    def set_system(self, system: str) -> None:
        """Set or replace the system prompt (saved with the next turn). The cached
        KV after it is recomputed on the next turn."""
        if not isinstance(system, str):
            raise InvalidMessageError("the system prompt must be a string")
        state = self._state
        msgs = state.messages
        if msgs and msgs[0].role == "system":
            if msgs[0].content == system:
                return
            msgs[0] = Message("system", system)
        else:
            msgs.insert(0, Message("system", system))
        state.history_dirty = True

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV this session holds on the device right now."""
        return self._state.seq.num_computed

    # -- turns -------------------------------------------------------------------

    #: ``await chat.asend(text)``: :meth:`send` for asyncio (see :mod:`chatkv.aio`).
    asend = aio.asend
    #: ``async for piece in chat.astream(text)``: :meth:`stream` for asyncio.
    astream = aio.astream

    def send(self, text: str, **sampling: Any) -> str:
        """Send a user message and return the assistant's whole reply.

        ``sampling`` overrides this chat's sampling defaults for this turn.
        See :meth:`stream` for errors and side effects.
        """
        return "".join(self.stream(text, **sampling))

    def stream(self, text: str, **sampling: Any) -> Iterator[str]:
        """Send a user message and yield the reply as text pieces as they are generated.

        The pieces concatenate to the reply (multi-byte characters are never
        split). The user message and the reply join the history when generation
        ends, and are saved with the KV the turn computed; if the consumer stops
        early or the process is interrupted (Ctrl-C) after the reply has begun,
        the partial reply is kept and marked ``partial``; if nothing was
        generated yet, the turn is rolled back. :attr:`last_stats` describes the
        turn. A failed save (full disk, read-only home) warns with
        :class:`~chatkv.errors.ChatKVWarning`; the conversation continues in
        memory and the next turn tries again.

        Raises:
            InvalidMessageError: ``text`` is empty or not a string (at the call).
            SessionBusyError: the chat is closed (at the call), or this session
                already has a turn in flight (when iteration starts).
            ContextWindowExceededError: the history plus ``text`` does not fit the
                model's context window (when iteration starts).
            OutOfBlocksError: the KV pool cannot hold the conversation.
            In every case the history is unchanged and the session still usable.
        """
        if not isinstance(text, str) or not text.strip():
            raise InvalidMessageError("a message must be a non-empty string")
        params = self.sampling.replace(**sampling) if sampling else self.sampling
        if self._closed:
            raise SessionBusyError(f"chat {self.session_id!r} is closed")
        return self._turn(self._state, text, params)

    def _turn(self, state: _Session, text: str, params: SamplingParams) -> Iterator[str]:
        started = time.perf_counter()
        state.ready.wait()
        if not state.busy.acquire(blocking=False):
            raise SessionBusyError(f"session {self.session_id!r} already has a turn in flight")
        engine = self.engine
        stats = TurnStats()
        result = GenerationResult()
        user = Message("user", text)
        try:
            ids = engine.encode_chat([m.as_dict() for m in state.messages + [user]])
            if len(ids) >= engine.max_context:
                raise ContextWindowExceededError(
                    f"the conversation plus this message is {len(ids)} tokens; the model's context "
                    f"window is {engine.max_context}. Start a new session or reset this one."
                )
            stats.kv_source = self.tiers.make_resident(state)
            self._align(state.seq, ids, stats)
            room = min(len(ids) + params.max_new_tokens, engine.max_context) - state.seq.num_computed
            self.tiers.reserve(state, min(engine.pool.blocks_needed(state.seq, room), engine.pool.num_blocks))
            generation_started = time.perf_counter()
            try:
                yield from engine.generate(state.seq, params, result)
            finally:
                if result.token_ids:
                    partial = result.finish_reason == "interrupted"
                    state.messages += [user, Message("assistant", result.text, partial=partial)]
                stats.prefilled_tokens = result.prefilled_tokens
                stats.generated_tokens = len(result.token_ids)
                stats.finish_reason = result.finish_reason
                if result.ttft_s is not None:  # as the caller sees it: restore and templating included
                    stats.ttft_s = generation_started - started + result.ttft_s
                stats.decode_tokens_per_s = result.decode_tokens_per_s
                self._persist(state, stats)
                stats.total_s = time.perf_counter() - started
                self.last_stats = stats
                self.last_generation = result
        finally:
            state.last_used = time.monotonic()
            state.busy.release()
        self.tiers.enforce_budgets()

    def _align(self, seq: Sequence, ids: list[int], stats: TurnStats) -> None:
        """Point ``seq`` at ``ids``: keep the cached KV of their longest common
        prefix, release the rest, and leave the remainder to be prefilled."""
        pool = self.engine.pool
        with self.engine.lock:
            cached = seq.num_computed
            keep = min(_lcp(seq.token_ids, ids), cached, len(ids) - 1)
            if keep < cached:
                pool.truncate(seq, keep)
            if seq.num_computed == 0 and not seq.block_table:
                keep = pool.match_prefix(seq, ids)
                stats.prefix_cache_tokens = keep
            seq.token_ids = list(ids)
        stats.prompt_tokens = len(ids)
        stats.reused_tokens = keep
        stats.discarded_tokens = cached - min(keep, cached) if stats.prefix_cache_tokens == 0 else 0

    def _persist(self, state: _Session, stats: TurnStats | None = None) -> None:
        """Save unsaved messages, then the KV chunks. Storage failures warn and
        leave the in-memory conversation intact (the next save retries)."""
        store, persister = state.store, state.persister
        if store is None or persister is None:
            return
        try:
            if state.history_dirty:
                store.truncate_history(self.session_id, 0)
                state.persisted_messages = 0
                state.history_dirty = False
            pending = state.messages[state.persisted_messages :]
            if pending:
                store.append_messages(self.session_id, [(m.role, m.content, None, m.partial) for m in pending])
                state.persisted_messages += len(pending)
            if state.tier == "device":  # demoted KV is already on disk (or expired)
                state.saved, result = persister.save(self.session_id, state.seq, state.saved)
                if stats is not None:
                    stats.bytes_written = result.bytes_written
        except StorageError as exc:
            message = f"could not save session {self.session_id!r}: {exc}; the conversation continues in memory"
            if stats is not None:
                stats.persist_error = message
            warnings.warn(message, ChatKVWarning, stacklevel=3)

    def save(self) -> None:
        """Save whatever of this session is not on disk yet (turns save themselves;
        this retries after a failed save). A no-op without persistence."""
        state = self._state
        state.ready.wait()
        with state.busy:
            self._persist(state)

    def reset(self) -> None:
        """Forget the conversation (keeping the system prompt), release its KV and
        save the emptied session."""
        state = self._state
        state.ready.wait()
        with state.busy:
            with self.engine.lock:
                self.engine.pool.release(state.seq)
            state.offloaded, state.tier = None, "device"
            state.messages[:] = [m for m in state.messages if m.role == "system"]
            state.history_dirty = True
            self._persist(state)

    def fork(self, session_id: str) -> "Chat":
        """A new session that starts as a copy of this one, sharing its KV blocks.

        The copy's blocks are shared by reference and copied on write, so forking
        costs no prefill and no KV memory until the two diverge; on disk the
        chunks are shared too.

        Raises:
            InvalidSessionIdError: a bad or already used ``session_id``.
        """
        validate_session_id(session_id)
        parent = self._state
        parent.ready.wait()
        with parent.busy:
            self.tiers.make_resident(parent)
        store = parent.store
        with self.engine.lock:
            if session_id in self.engine.sessions or (store is not None and store.has_session(session_id)):
                raise InvalidSessionIdError(f"session {session_id!r} already exists")
            child = _Session(
                session_id,
                messages=[dataclasses.replace(m) for m in parent.messages],
                seq=self.engine.pool.fork(parent.seq),
                history_dirty=True,
            )
            child.ready.set()
            self.engine.sessions[session_id] = child
        if store is not None and parent.persister is not None:
            store.open_session(session_id, fingerprint=self.engine.loaded.fingerprint, system_prompt=self.system)
            store.acquire_lease(session_id)
            child.store, child.persister = store, KVPersister(self.engine, store, parent.persister.chunk_tokens)
        chat = Chat(session_id, engine=self.engine, **dataclasses.asdict(self.sampling))
        chat._persist(child)
        return chat

    def close(self) -> None:
        """Save the session, release its KV blocks and its lease. Idempotent.

        A persistent session leaves this process's memory (``Chat(session_id)``
        later reloads it from disk, sharing any blocks still cached); an
        in-process one keeps its history so it can be continued.
        """
        if self._closed:
            return
        state = self._state
        state.ready.wait()
        with state.busy:
            self._persist(state)
            with self.engine.lock:
                self.engine.pool.release(state.seq)
                state.offloaded = None
                if state.store is not None:
                    self.engine.sessions.pop(self.session_id, None)
            if state.store is not None:
                state.store.release_lease(self.session_id)
        self._closed = True

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Chat({self.session_id!r}, messages={len(self._state.messages)}, "
                f"cached_tokens={self.num_cached_tokens})")
