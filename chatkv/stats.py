"""What a turn and a restore report: :class:`TurnStats` and :class:`RestoreInfo`.

One :class:`TurnStats` describes one turn from the call to the last token:
the scheduler fills in the generation (tokens, text, timing, preemptions), the
session layer the prompt (reuse, where the KV came from, why it was not
reused) and the save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatkv.tiers import Tier


@dataclass
class TurnStats:
    """What one turn cost, what it produced and where its KV came from.

    Attributes:
        prompt_tokens: tokens of the whole templated history plus the new turn.
        reused_tokens: of those, tokens whose KV was already cached (not recomputed).
        prefilled_tokens: tokens computed by this turn's prefill.
        discarded_tokens: cached tokens that no longer matched the template of
            the history (a rewound or edited turn, a reply that re-tokenizes
            differently) and were released.
        prefix_cache_tokens: reused tokens found in blocks other sessions share.
        trimmed_messages: messages this turn left out of the model's window
            (``context_policy="trim"`` or ``"sink"``; the history keeps them).
        shifted_tokens: tokens the ``sink`` policy dropped from the cache this
            turn (the kept keys were shifted in place, not recomputed).
        token_ids: the generated token ids (the last may be EOS).
        text: the generated text (stop strings excluded).
        finish_reason: ``"eos"``, ``"stop"``, ``"length"``, ``"context"``,
            ``"interrupted"`` or, for a turn that only prefilled, ``"prefilled"``.
        started_at: ``time.perf_counter()`` when the turn was asked for.
        ttft_s: seconds from ``started_at`` to the first token, including
            waiting for a restore, promotion from a lower tier and templating.
        decode_s: seconds from the first token to the last.
        total_s: seconds of the whole turn, the save included.
        preemptions: times the scheduler released this turn's KV under memory pressure.
        recomputed_tokens: tokens computed again after preemptions.
        kv_source: the tier the session's KV was in when the turn started.
        not_reused: why cached KV was not reused where it was not (the history
            diverged at a token, the KV expired or was evicted, a chunk was
            quarantined, another model's cache), or None.
        bytes_written: bytes of chunk files this turn's save wrote.
        persist_error: why the turn could not be saved (the conversation
            continues in memory), or None.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    discarded_tokens: int = 0
    prefix_cache_tokens: int = 0
    trimmed_messages: int = 0
    shifted_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    started_at: float | None = None
    ttft_s: float | None = None
    decode_s: float = 0.0
    total_s: float = 0.0
    preemptions: int = 0
    recomputed_tokens: int = 0
    kv_source: Tier = Tier.DEVICE
    not_reused: str | None = None
    bytes_written: int = 0
    persist_error: str | None = None

    @property
    def generated_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one (None with fewer than two tokens)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


@dataclass
class RestoreInfo:
    """How a session came back when it was opened.

    Attributes:
        source: ``"new"`` (nothing stored: no such session, or one without
            messages or KV), ``"memory"`` (already open in
            this process), ``"disk"`` (KV loaded from chunk files; a prefix may
            have come from blocks other sessions share), or ``"history"``
            (messages restored but the KV was unusable or absent: the next turn
            re-prefills).
        turns: user turns in the restored history.
        cached_tokens: tokens whose KV is resident after the restore.
        seconds: wall time of the restore.
        bytes_read: bytes of chunk files read.
        warning: why the KV was (partly) not used, if it was not.
        decision: for KV on disk, ``"restore"`` (read back) or ``"recompute"``
            (left for the next turn's prefill: predicted faster); None otherwise.
        reason: the predictions behind ``decision`` (see :mod:`chatkv.costs`).
    """

    source: str
    turns: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    warning: str | None = None
    decision: str | None = None
    reason: str | None = None
