"""``Chat``: a multi-turn conversation whose KV cache is reused across turns."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from chatkv.config import EngineConfig, SamplingParams
from chatkv.engine import Engine, GenerationResult, get_engine
from chatkv.errors import (
    ContextWindowExceededError,
    InvalidMessageError,
    InvalidSessionIdError,
    SessionBusyError,
)
from chatkv.models import LoadedModel
from chatkv.sequence import Sequence

MAX_SESSION_ID_LEN = 128
_SESSION_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a safe id, else raise :class:`InvalidSessionIdError`.

    Safe: a string of 1 to 128 characters from ``[A-Za-z0-9._-]`` that does not
    start with ``.`` or ``-`` (so never ``..``, never a path, never an option).
    """
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"a session id must be a string, got {type(session_id).__name__}")
    if not 0 < len(session_id) <= MAX_SESSION_ID_LEN or not _SESSION_ID_RE.fullmatch(session_id):
        raise InvalidSessionIdError(
            f"invalid session id {session_id[:40]!r}: use 1 to {MAX_SESSION_ID_LEN} characters from "
            "A-Z a-z 0-9 . _ - , not starting with '.' or '-'"
        )
    return session_id


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
        prefix_cache_tokens: reused tokens found in other sessions' shared blocks.
        generated_tokens, finish_reason, ttft_s, decode_tokens_per_s, total_s.
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


@dataclass
class _Session:
    """In-process state of one session, shared by every ``Chat`` opened on it."""

    session_id: str
    messages: list[Message] = field(default_factory=list)
    seq: Sequence = field(default_factory=Sequence)
    busy: threading.Lock = field(default_factory=threading.Lock)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Chat:
    """A conversation with a chat model whose KV cache persists across turns.

    ``Chat("user-42")`` opens the session ``user-42`` (creating it if new). Each
    :meth:`send` templates the history plus the new message, reuses the cached
    KV of the longest prefix that still matches, prefills only the rest and
    generates a reply. Sessions with the same system prompt share its KV blocks.

    Args:
        session_id: 1-128 characters from ``[A-Za-z0-9._-]``.
        system: the system prompt. For an existing session, a different value
            replaces its system prompt (the KV after it is recomputed); None keeps it.
        model: a model spec (see :func:`chatkv.models.load_model`) or a
            :class:`~chatkv.models.LoadedModel`; None is the default model.
        engine: an explicit :class:`~chatkv.engine.Engine` (overrides ``model``).
        engine_config: pool settings for a new engine.
        **sampling: defaults for :class:`~chatkv.config.SamplingParams`
            (``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_new_tokens``, ``stop``).

    Raises:
        InvalidSessionIdError: a bad ``session_id``.
        ConfigError: an unknown sampling option.
    """

    def __init__(
        self,
        session_id: str,
        system: str | None = None,
        model: str | LoadedModel | None = None,
        *,
        engine: Engine | None = None,
        engine_config: EngineConfig | None = None,
        **sampling: Any,
    ) -> None:
        self.session_id = validate_session_id(session_id)
        self.sampling = SamplingParams.from_dict(sampling)
        self.engine = engine or get_engine(model, engine_config)
        self.last_stats: TurnStats | None = None
        #: Token ids, text and finish reason of the last turn's generation.
        self.last_generation: GenerationResult | None = None
        self._closed = False
        with self.engine.lock:
            state = self.engine.sessions.get(session_id)
            if state is None:
                state = _Session(session_id)
                self.engine.sessions[session_id] = state
        self._state: _Session = state
        if system is not None:
            self.set_system(system)

    # -- history -----------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, str]]:
        """A copy of the history as ``[{"role", "content"}, ...]``."""
        return [m.as_dict() for m in self._state.messages]

    @property
    def history(self) -> list[Message]:
        """A copy of the history with per-message flags (e.g. ``partial``)."""
        return [Message(m.role, m.content, m.partial) for m in self._state.messages]

    @property
    def system(self) -> str | None:
        """The current system prompt, if any."""
        msgs = self._state.messages
        return msgs[0].content if msgs and msgs[0].role == "system" else None

    def set_system(self, system: str) -> None:
        """Set or replace the system prompt. Cached KV after it is recomputed next turn."""
        if not isinstance(system, str):
            raise InvalidMessageError("the system prompt must be a string")
        msgs = self._state.messages
        if msgs and msgs[0].role == "system":
            msgs[0] = Message("system", system)
        else:
            msgs.insert(0, Message("system", system))

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV this session holds right now."""
        return self._state.seq.num_computed

    # -- turns -------------------------------------------------------------------

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
        ends; if the consumer stops early or the process is interrupted
        (Ctrl-C) after the reply has begun, the partial reply is kept and marked
        ``partial``; if nothing was generated yet, the turn is rolled back.
        :attr:`last_stats` describes the turn.

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
        if not state.busy.acquire(blocking=False):
            raise SessionBusyError(f"session {self.session_id!r} already has a turn in flight")
        engine = self.engine
        stats = TurnStats()
        started = time.perf_counter()
        result = GenerationResult()
        user = Message("user", text)
        try:
            ids = self._template(state.messages + [user])
            if len(ids) >= engine.max_context:
                raise ContextWindowExceededError(
                    f"the conversation plus this message is {len(ids)} tokens; the model's context "
                    f"window is {engine.max_context}. Start a new session or reset this one."
                )
            self._align(state.seq, ids, stats)
            try:
                yield from engine.generate(state.seq, params, result)
            finally:
                if result.token_ids:
                    partial = result.finish_reason == "interrupted"
                    state.messages += [user, Message("assistant", result.text, partial=partial)]
                stats.prefilled_tokens = result.prefilled_tokens
                stats.generated_tokens = len(result.token_ids)
                stats.finish_reason = result.finish_reason
                stats.ttft_s = result.ttft_s
                stats.decode_tokens_per_s = result.decode_tokens_per_s
                stats.total_s = time.perf_counter() - started
                self.last_stats = stats
                self.last_generation = result
        finally:
            state.busy.release()

    def _template(self, messages: list[Message]) -> list[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template([m.as_dict() for m in messages], tokenize=False,
                                       add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])

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

    def reset(self) -> None:
        """Forget the conversation (keeping the system prompt) and release its KV."""
        state = self._state
        with state.busy:
            with self.engine.lock:
                self.engine.pool.release(state.seq)
            state.messages[:] = [m for m in state.messages if m.role == "system"]

    def fork(self, session_id: str) -> "Chat":
        """A new session that starts as a copy of this one, sharing its KV blocks.

        The copy's blocks are shared by reference and copied on write, so forking
        costs no prefill and no KV memory until the two diverge.

        Raises:
            InvalidSessionIdError: a bad or already used ``session_id``.
        """
        validate_session_id(session_id)
        with self.engine.lock:
            if session_id in self.engine.sessions:
                raise InvalidSessionIdError(f"session {session_id!r} already exists")
            child = _Session(
                session_id,
                messages=[Message(m.role, m.content, m.partial) for m in self._state.messages],
                seq=self.engine.pool.fork(self._state.seq),
            )
            self.engine.sessions[session_id] = child
        return Chat(session_id, engine=self.engine, **_sampling_dict(self.sampling))

    def close(self) -> None:
        """Release this session's KV blocks. The history stays in the process, so
        ``Chat(session_id)`` later continues the conversation (re-prefilling
        what the prefix cache no longer holds). Idempotent."""
        if self._closed:
            return
        state = self._state
        with state.busy:
            with self.engine.lock:
                self.engine.pool.release(state.seq)
        self._closed = True

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Chat({self.session_id!r}, messages={len(self._state.messages)}, cached_tokens={self.num_cached_tokens})"


def _sampling_dict(params: SamplingParams) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(params)
