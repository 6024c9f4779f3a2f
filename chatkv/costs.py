"""Restore or recompute: whether a session's KV on disk is worth reading back.

A session that comes back from disk can have its KV read from the chunk
files, or recomputed by the next turn's prefill from its history. Both give
the same answers (restored KV is exact; a re-prefill is what a fresh session
does). Which is faster depends on the machine: on a CPU prefill is slow and
reading ~46 KB per token is not, so restoring wins by an order of magnitude;
on a GPU a short history prefills faster than its KV can be read (SGLang's
users measured disk hits slower than recompute at 8k tokens, sglang#26305).

:class:`CostModel` learns both rates on the engine it serves (the warm-up and
every prefill step feed the prefill rate, every restore the disk's) as a
linear fit ``seconds = fixed + per_unit * size`` over recent samples, and
:meth:`CostModel.choose` predicts both times for one session and picks one;
the choice and its reason go into the restore's :class:`~chatkv.stats.RestoreInfo`
and, when it recomputes, the next turn's ``not_reused``. Until both rates have
been measured it restores. ``EngineConfig(restore_policy=...)`` or
``$CHATKV_RESTORE_POLICY`` may force ``"restore"`` or ``"recompute"``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass

from chatkv.errors import ConfigError

RESTORE_POLICIES = ("auto", "restore", "recompute")
POLICY_ENV = "CHATKV_RESTORE_POLICY"
#: Prefill steps shorter than this are not timed: per-step overhead would dominate them.
MIN_PREFILL_TOKENS = 32
#: Recompute is chosen only when predicted this many times faster: a restore
#: leaves the compute to other sessions' turns, a re-prefill takes it.
RECOMPUTE_ADVANTAGE = 1.25
_SAMPLES = 32


def resolve_policy(value: str | None) -> str:
    """``value``, else ``$CHATKV_RESTORE_POLICY``, else ``"auto"``; checked.

    Raises:
        ConfigError: not one of :data:`RESTORE_POLICIES`.
    """
    policy = value or os.environ.get(POLICY_ENV) or "auto"
    if policy not in RESTORE_POLICIES:
        raise ConfigError(f"restore_policy must be one of {', '.join(RESTORE_POLICIES)}, got {policy!r}")
    return policy


class LinearCost:
    """``seconds ≈ fixed + per_unit * size``, fitted (least squares) to the last samples. Thread-safe."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=_SAMPLES)
        self._mu = threading.Lock()

    def add(self, size: float, seconds: float) -> None:
        """Record one measurement (ignored unless both are positive)."""
        if size > 0 and seconds > 0:
            with self._mu:
                self._samples.append((float(size), float(seconds)))

    def fit(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per unit)``, or None before any sample.

        With one size only (or a fit that would make either term negative) the
        fixed term is 0 and the per-unit cost the samples' mean ratio.
        """
        with self._mu:
            samples = list(self._samples)
        if not samples:
            return None
        n = len(samples)
        mx = sum(s for s, _ in samples) / n
        my = sum(t for _, t in samples) / n
        var = sum((s - mx) ** 2 for s, _ in samples)
        if var > 0:
            slope = sum((s - mx) * (t - my) for s, t in samples) / var
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, sum(t for _, t in samples) / sum(s for s, _ in samples)

    def predict(self, size: float) -> float | None:
        """Predicted seconds for ``size`` units, or None before any sample."""
        got = self.fit()
        return None if got is None else got[0] + got[1] * size


@dataclass(frozen=True)
class Choice:
    """What :meth:`CostModel.choose` decided: ``"restore"`` or ``"recompute"``, why,
    and the two predictions (None where a rate is not known yet)."""

    decision: str
    reason: str
    restore_s: float | None = None
    recompute_s: float | None = None


class CostModel:
    """The measured prefill and disk-restore costs of one engine, and the choice between them."""

    def __init__(self, policy: str = "auto") -> None:
        self.policy = resolve_policy(policy)
        self.prefill = LinearCost()
        """Seconds per forward step by its token count."""
        self.disk = LinearCost()
        """Seconds per restore from disk by the bytes it read."""

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """One forward step of ``tokens`` new tokens took ``seconds`` (short steps are ignored)."""
        if tokens >= MIN_PREFILL_TOKENS:
            self.prefill.add(tokens, seconds)

    def record_restore(self, n_bytes: int, seconds: float) -> None:
        """One restore from disk read ``n_bytes`` in ``seconds``."""
        self.disk.add(n_bytes, seconds)

    def choose(self, n_tokens: int, n_bytes: int) -> Choice:
        """Restore ``n_bytes`` of stored KV, or recompute its ``n_tokens`` tokens?"""
        if self.policy != "auto":
            return Choice(self.policy, f"restore_policy={self.policy!r}")
        fit = self.prefill.fit()
        restore_s = self.disk.predict(n_bytes)
        recompute_s = None if fit is None else fit[1] * n_tokens  # a turn's own step pays the fixed part
        if restore_s is None or recompute_s is None:
            return Choice("restore", "no measured " + ("disk bandwidth" if restore_s is None else "prefill rate")
                          + " yet", restore_s, recompute_s)
        what = (f"reading {n_bytes / 1e6:.1f} MB is predicted to take {restore_s * 1e3:.0f} ms, "
                f"prefilling {n_tokens} tokens {recompute_s * 1e3:.0f} ms")
        if recompute_s * RECOMPUTE_ADVANTAGE < restore_s:
            return Choice("recompute", f"recomputed instead of restored: {what}", restore_s, recompute_s)
        return Choice("restore", what, restore_s, recompute_s)
