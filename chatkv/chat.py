"""``Chat``: a multi-turn conversation whose KV cache persists across turns,
processes and restarts. A thin handle over a :class:`chatkv.session.Session`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from chatkv import aio
from chatkv.config import EngineConfig, SamplingParams, TierConfig
from chatkv.engine import Engine, engine_for
from chatkv.errors import ConfigError, InvalidMessageError, InvalidSessionIdError, SessionBusyError
from chatkv.models import LoadedModel
from chatkv.persistence import default_store
from chatkv import history
from chatkv.session import CONTEXT_POLICIES, DEFAULT_CHUNK_TOKENS, Message, Session, SinkPolicy, rope_shift
from chatkv.stats import RestoreInfo, TurnStats
from chatkv.storage import InvalidSessionIdError as _StorageIdError
from chatkv.storage import Store
from chatkv.storage import validate_session_id as _validate_id
from chatkv.tiers import Tier

__all__ = ["Chat", "Message", "TurnStats", "validate_session_id"]


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a safe id, else raise :class:`InvalidSessionIdError`.

    Safe: a string of 1 to 128 characters from ``[A-Za-z0-9._-]`` that does not
    start with ``.`` (so never ``..``). Ids are index keys, never paths.
    """
    try:
        return _validate_id(session_id)
    except _StorageIdError as exc:
        raise InvalidSessionIdError(str(exc)) from None


class Chat:
    """A conversation with a chat model whose KV cache persists across turns and restarts.

    ``Chat("user-42")`` opens the session ``user-42``, creating it if new. With
    ``persist=True`` (the default) its history and KV live in the store under
    ``$CHATKV_HOME``: opening takes the session's lease (another process using
    the same id gets :class:`~chatkv.storage.SessionLockedError`) and starts
    loading its KV from disk in the background; the first turn waits for that.
    Each turn templates the history, reuses the cached KV of the longest prefix
    that still matches, prefills only the rest, generates, then saves. Two
    ``Chat`` objects on one id in a process share the session; it is saved and
    let go when the last one closes.

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
        lease_timeout_s: how long to wait for another process to release the
            session (or for its lease to expire, if it died) instead of failing.
        context_policy: when the history outgrows the window: ``"trim"`` (the
            default) leaves the oldest whole turns after the system prompt out
            of the window (the history keeps them); ``"sink"`` keeps the first
            ``sink_tokens`` and the most recent tokens in the cache, dropping
            the oldest ones after the sink and shifting the kept keys' rotary
            positions in place, so nothing is re-prefilled (StreamingLLM;
            refused with :class:`~chatkv.errors.ConfigError` for a model whose
            positions cannot be shifted exactly); ``"error"`` raises
            :class:`~chatkv.errors.ContextWindowExceededError`.
        sink_tokens, sink_window: the ``sink`` policy's sizes (see
            :class:`chatkv.session.SinkPolicy`): tokens always kept at the start
            (rounded up to whole KV blocks), and how many tokens a drop keeps
            (None: half the window).
        tiers, kv_quant: the engine's tier policy (``kv_quant`` is shorthand for
            ``tiers.quant_scheme``). Engine-wide: they pick (or build) an engine
            with that policy; with an explicit ``engine`` they must match its own.
        pin: True keeps this session's KV on the device however long it idles
            (idle policies skip it; memory pressure demotes it only after every
            other idle session; gc never expires its stored KV by TTL); False
            unpins it; None (the default) keeps what the store says
            (``chatkv sessions pin/unpin``). Saved with the session.
        ttl: this session's KV expires after this many idle seconds, whatever
            the engine's and the store's TTL (its history stays); None keeps
            what the store says (``chatkv sessions ... --ttl``). Saved with
            the session, so ``chatkv sessions gc`` honours it too.
        **sampling: defaults for :class:`~chatkv.config.SamplingParams`.

    Raises:
        InvalidSessionIdError: a bad ``session_id``.
        SessionLockedError: another process holds the session.
        SessionBusyError: the session is open on another engine in this process.
        ConfigError: an unknown sampling option, or tier policy that conflicts with ``engine``.
        StorageError: the store cannot be opened.
    """

    def __init__(self, session_id: str, system: str | None = None, model: str | LoadedModel | None = None, *,
                 engine: Engine | None = None, engine_config: EngineConfig | None = None,
                 store: Store | None = None, persist: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 lease_timeout_s: float = 0.0, tiers: TierConfig | None = None, kv_quant: str | None = None,
                 context_policy: str = "trim", sink_tokens: int = 4, sink_window: int | None = None,
                 pin: bool | None = None, ttl: float | None = None, **sampling: Any) -> None:
        self.session_id = validate_session_id(session_id)
        self.sampling = SamplingParams.from_dict(sampling)
        if context_policy not in CONTEXT_POLICIES:
            raise ConfigError(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl >= 0):
            raise ConfigError(f"ttl must be a number of seconds >= 0 or None, got {ttl!r}")
        #: What a turn does when the history outgrows the window (see :data:`chatkv.session.CONTEXT_POLICIES`).
        self.context_policy = context_policy
        #: The ``sink`` policy's sizes.
        self.sink = SinkPolicy(sink_tokens, sink_window)
        if system is not None and not isinstance(system, str):
            raise InvalidMessageError("the system prompt must be a string")
        # The store first: a new one warms up its statements while a model loads.
        store = (store or default_store()) if persist else None
        self.engine = engine_for(model, engine, engine_config, tiers, kv_quant)
        if context_policy == "sink":
            rope_shift(self.engine)  # ConfigError for a model whose positions cannot be shifted
        if system is not None:
            history.check_text(system, self._max_chars, "the system prompt")
        #: What the last turn cost, produced and reused (see :class:`~chatkv.stats.TurnStats`).
        self.last_stats: TurnStats | None = None
        self._closed = False
        self._session: Session = self.engine.sessions.open(
            self.session_id, store=store, chunk_tokens=chunk_tokens,
            lease_timeout_s=lease_timeout_s, system=system)
        if pin is not None or ttl is not None:
            self._session.set_retention(pin, ... if ttl is None else ttl)
        if system is not None:
            self.set_system(system)

    # -- state ----------------------------------------------------------------------

    def wait_restored(self, timeout: float | None = None) -> RestoreInfo:
        """Block until the session's KV is loaded (a no-op for new or resident
        sessions) and return how it came back.

        Raises:
            TimeoutError: not loaded within ``timeout`` seconds.
        """
        if not self._session.ready.wait(timeout):
            raise TimeoutError(f"session {self.session_id!r} is still loading")
        return self._session.restore

    @property
    def restore(self) -> RestoreInfo:
        """How this session came back; complete once :meth:`wait_restored` returns."""
        return self._session.restore

    @property
    def messages(self) -> list[dict[str, str]]:
        """A copy of the history as ``[{"role", "content"}, ...]``."""
        return [m.as_dict() for m in self._session.messages]

    @property
    def history(self) -> list[Message]:
        """A copy of the history with per-message flags (e.g. ``partial``)."""
        return [dataclasses.replace(m) for m in self._session.messages]

    @property
    def system(self) -> str | None:
        """The current system prompt, if any."""
        msgs = self._session.messages
        return msgs[0].content if msgs and msgs[0].role == "system" else None

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV this session holds on the device right now."""
        return self._session.kv.seq.num_computed

    @property
    def tier(self) -> Tier:
        """Where the session's KV lives now."""
        return self._session.kv.tier

    # -- turns ----------------------------------------------------------------------

    #: ``await chat.asend(text)``: :meth:`send` for asyncio (see :mod:`chatkv.aio`).
    asend = aio.asend
    #: ``async for piece in chat.astream(text)``: :meth:`stream` for asyncio.
    astream = aio.astream

    def send(self, text: str, **sampling: Any) -> str:
        """Send a user message and return the assistant's whole reply (see :meth:`stream`)."""
        return "".join(self.stream(text, **sampling))

    def stream(self, text: str, **sampling: Any) -> Iterator[str]:
        """Send a user message and yield the reply as text pieces as they are generated.

        The pieces concatenate to the reply. The user message and the reply join
        the history when generation ends and are saved with the KV the turn
        computed; if the consumer stops early or is interrupted (Ctrl-C) after
        the reply has begun, the partial reply is kept and marked ``partial``;
        if nothing was generated yet, the history is unchanged.
        :attr:`last_stats` describes the turn. A failed save (full disk) warns
        with :class:`~chatkv.errors.ChatKVWarning`; the conversation continues
        in memory and the next turn tries again.

        Raises:
            InvalidMessageError: ``text`` is empty or not a string (at the call).
            SessionBusyError: the chat is closed (at the call), or this session
                already has a turn in flight (when iteration starts).
            ContextWindowExceededError: the history plus ``text`` does not fit the
                model's context window (when iteration starts).
            OutOfBlocksError, QueueFullError: the pool or the queue is full.
            In every case the history is unchanged and the session still usable.
            LeaseLostError: this process lost the session's lease (it was
                paused or cut off past the lease's expiry and another process
                took the session over): nothing is saved from here on, and
                every later turn raises it too; close and reopen the ``Chat``.
        """
        user = Message("user", self._text(text))
        return self._generate(lambda msgs: msgs + [user], sampling)

    def regenerate(self, **sampling: Any) -> str:
        """Replace the last reply with a new one (on the same history) and return it."""
        return "".join(self.stream_regenerate(**sampling))

    def stream_regenerate(self, **sampling: Any) -> Iterator[str]:
        """:meth:`regenerate`, streaming. Raises :class:`EditError` without a reply to replace."""
        return self._generate(history.for_regenerate, sampling)

    def edit(self, index: int, text: str, **sampling: Any) -> str:
        """Replace the user message at ``index`` of :attr:`messages` with ``text``,
        drop everything after it, and return the new reply (as :meth:`send`)."""
        return "".join(self.stream_edit(index, text, **sampling))

    def stream_edit(self, index: int, text: str, **sampling: Any) -> Iterator[str]:
        """:meth:`edit`, streaming. Raises :class:`EditError` if ``index`` is not a user message."""
        user = Message("user", self._text(text))
        return self._generate(lambda msgs: history.for_edit(msgs, index, user), sampling)

    def complete(self, messages: Iterable[dict[str, str] | Message], **sampling: Any) -> str:
        """Reply to exactly ``messages`` (ending with a user message), making them
        the history: the KV of the prefix they share with the current history is
        reused, the rest is prefilled, and the stored history is rewritten where
        it differs. What a server does with a client that sends the whole
        conversation each turn."""
        return "".join(self.stream_complete(messages, **sampling))

    def stream_complete(self, messages: Iterable[dict[str, str] | Message], **sampling: Any) -> Iterator[str]:
        """:meth:`complete`, streaming.

        Raises:
            InvalidMessageError: a malformed message, or the last one is not from the user.
        """
        new = [Message.parse(m) for m in messages]
        for m in new:
            history.check_text(m.content, self._max_chars, f"a {m.role} message", allow_empty=m.role == "assistant")
        base = history.for_complete(new)
        return self._generate(lambda msgs: base, sampling)

    def append(self, messages: Iterable[dict[str, str] | Message]) -> TurnStats:
        """Add existing messages to the history without generating, computing and
        saving their KV (teacher forcing): how an app brings a stored chat into
        chatkv. A ``system`` message may only come first in the history.

        Raises:
            InvalidMessageError: a malformed message. ContextWindowExceededError:
            the result does not fit the window. The history is then unchanged.
        """
        new = [Message.parse(m) for m in messages]
        for m in new:
            history.check_text(m.content, self._max_chars, f"a {m.role} message", allow_empty=m.role == "assistant")
        session, stats = self._session, TurnStats(started_at=time.perf_counter())
        with self._turn_lock(ready=False):
            base = history.appended(session.messages, new)
            if base:
                session.prefill(base, stats, self.context_policy, self.sink, new_messages=len(new))
        self.last_stats = stats
        return stats

    def rewind(self, turns: int = 1) -> list[dict[str, str]]:
        """Drop the last ``turns`` user turns (each user message and what followed
        it) and return the removed messages. The kept prefix's KV is reused.

        Raises:
            EditError: fewer than ``turns`` user turns in the history.
        """
        with self._turn_lock():
            kept, removed = history.rewound(self._session.messages, turns)
            self._session.set_history(kept)
            return [m.as_dict() for m in removed]

    def _generate(self, base: Callable[[list[Message]], list[Message]], sampling: dict[str, Any]) -> Iterator[str]:
        params = self.sampling.replace(**sampling) if sampling else self.sampling
        self._check_open()
        return self._run(base, params, time.perf_counter())

    def _run(self, base: Callable[[list[Message]], list[Message]], params: SamplingParams,
             started: float) -> Iterator[str]:
        stats = TurnStats(started_at=started)
        with self._turn_lock(ready=False):
            try:
                yield from self._session.turn(base(list(self._session.messages)), params, stats,
                                              self.context_policy, self.sink)
            finally:
                self.last_stats = stats

    # -- history --------------------------------------------------------------------

    def set_system(self, system: str) -> None:
        """Set or replace the system prompt (saved now); the KV after it is
        recomputed on the next turn."""
        with self._turn_lock():
            msgs = history.with_system(self._session.messages, system)
            if msgs is not None:
                self._session.set_history(msgs)

    def reset(self) -> None:
        """Forget the conversation (keeping the system prompt), release its KV and
        save the emptied session."""
        with self._turn_lock():
            self._session.forget_kv()
            self._session.set_history([m for m in self._session.messages if m.role == "system"])

    def save(self) -> None:
        """Save whatever of this session is not on disk yet (turns save themselves;
        this retries after a failed save). A no-op without persistence."""
        with self._turn_lock():
            self._session.persist()

    def fork(self, session_id: str) -> "Chat":
        """A new session that starts as a copy of this one, sharing its KV blocks
        (copy on write, on disk too): forking costs no prefill and no KV memory
        until the two diverge.

        Raises:
            InvalidSessionIdError: a bad or already used ``session_id``.
        """
        validate_session_id(session_id)
        self._check_open()
        child = Chat._over(self.engine.sessions.fork(self._session, session_id), self.sampling)
        child.context_policy, child.sink = self.context_policy, self.sink
        return child

    @classmethod
    def _over(cls, session: Session, sampling: SamplingParams) -> "Chat":
        """A handle over an already opened ``session`` (which counts it)."""
        chat = cls.__new__(cls)
        chat.session_id, chat.sampling, chat.engine = session.session_id, sampling, session.engine
        chat.last_stats, chat._closed, chat._session = None, False, session
        chat.context_policy, chat.sink = "trim", SinkPolicy()
        return chat

    def close(self) -> None:
        """Let go of this handle; the last handle on the session saves it and
        releases its KV blocks and its lease. Idempotent. A persistent session
        leaves this process's memory (a later ``Chat`` reloads it from disk); an
        in-process one keeps its history so it can be continued."""
        if not self._closed:
            self._closed = True
            self.engine.sessions.close(self._session)

    # -- helpers --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SessionBusyError(f"chat {self.session_id!r} is closed")

    def _turn_lock(self, ready: bool = True) -> "_Held":
        """Claim the session for a turn, once its restore is done unless ``ready``
        is False (a turn or an append, which template their history while the
        restore runs and wait in the session); SessionBusyError if one runs."""
        self._check_open()
        session = self._session
        if ready:
            session.ready.wait()
        session.begin_turn()
        return _Held(session)

    @property
    def _max_chars(self) -> int:
        from chatkv.models import max_token_chars

        return self.engine.max_context * max_token_chars(self.engine.tokenizer)

    def _text(self, text: object) -> str:
        return history.check_text(text, self._max_chars)

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Chat({self.session_id!r}, messages={len(self._session.messages)}, "
                f"cached_tokens={self.num_cached_tokens})")


class _Held:
    """A turn already claimed on a session, ended on ``__exit__``."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._session.end_turn()
