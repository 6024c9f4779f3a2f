"""Restore or recompute: whether a session's KV on disk is worth reading back.

A session that comes back from disk can have its KV read from the chunk
files, or recomputed by the next turn's prefill from its history. Both give
the same answers (restored KV is exact; a re-prefill is what a fresh session
does). Which is faster depends on the machine: on a CPU prefill is slow and
reading ~46 KB per token is not, so restoring wins by an order of magnitude;
on a GPU a short history prefills faster than its KV can be read (SGLang's
users measured disk hits slower than recompute at 8k tokens, sglang#26305).

:class:`CostModel` learns both rates on the engine it serves (the warm-up and
every prefill step mostly over its own tokens feed the prefill rate, every
restore the disk's) as a robust linear fit ``seconds = fixed + per_unit *
size`` over recent samples, and
:meth:`CostModel.choose` predicts both times for one session and picks one;
the choice and its reason go into the restore's :class:`~chatkv.stats.RestoreInfo`
and, when it recomputes, the next turn's ``not_reused``. Until both rates have
been measured it restores. ``EngineConfig(restore_policy=...)`` or
``$CHATKV_RESTORE_POLICY`` may force ``"restore"`` or ``"recompute"``.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass

from chatkv.errors import ConfigError

RESTORE_POLICIES = ("auto", "restore", "recompute")
POLICY_ENV = "CHATKV_RESTORE_POLICY"
#: Prefill steps shorter than this are not timed: per-step overhead would dominate them.
MIN_PREFILL_TOKENS = 32
#: Recompute is chosen only when its first step is predicted this many times
#: faster: a restore leaves the compute to other sessions' turns, a re-prefill takes it.
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

        A Theil-Sen fit: the slope is the median of the slopes between pairs of
        samples of different sizes, the fixed part the median of what each
        sample leaves over it. Unlike least squares it ignores a few outliers,
        such as a step that compiled a kernel on its first run. With one size
        only, the fixed part is 0 and the per-unit cost the samples' mean
        ratio. A slope lost in the noise (the median not positive) counts as 0:
        the time is all fixed.
        """
        with self._mu:
            samples = list(self._samples)
        if not samples:
            return None
        slopes = [(t2 - t1) / (s2 - s1) for i, (s1, t1) in enumerate(samples)
                  for s2, t2 in samples[i + 1:] if s2 != s1]
        if not slopes:
            return 0.0, sum(t for _, t in samples) / sum(s for s, _ in samples)
        slope = max(0.0, statistics.median(slopes))
        return max(0.0, statistics.median(t - slope * s for s, t in samples)), slope

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

    def __init__(self, policy: str = "auto", max_step_tokens: int | None = None) -> None:
        """``policy``: see :func:`resolve_policy`. ``max_step_tokens``: the most
        tokens one prefill step takes (``EngineConfig.max_prefill_tokens``);
        a longer recompute runs in several steps and pays the fixed part of
        each one but the first. None: one step, however long."""
        self.policy = resolve_policy(policy)
        self.max_step_tokens = max_step_tokens
        self.prefill = LinearCost()
        """Seconds per forward step by its token count."""
        self.disk = LinearCost()
        """Seconds per restore from disk by the bytes it read."""

    def record_prefill(self, tokens: int, seconds: float, context: int = 0) -> None:
        """One forward step of ``tokens`` new tokens over ``context`` tokens
        already cached took ``seconds``. Only steps of at least
        :data:`MIN_PREFILL_TOKENS` mostly over their own tokens (``context`` at
        most ``tokens``) are kept: what a recompute runs. A short turn over a
        long history costs mostly its attention to that history; fitted per
        new token beside fresh prefills, turns of sessions with different
        histories made the slope negative, so it counted as 0 and a
        recompute of any length was predicted to be free."""
        if tokens >= MIN_PREFILL_TOKENS and context <= tokens:
            self.prefill.add(tokens, seconds)

    def record_restore(self, n_bytes: int, seconds: float) -> None:
        """One restore from disk read ``n_bytes`` in ``seconds``."""
        self.disk.add(n_bytes, seconds)

    def choose(self, n_tokens: int, n_bytes: int) -> Choice:
        """Restore ``n_bytes`` of stored KV, or recompute its ``n_tokens`` tokens?

        Recomputing is predicted to cost the per-token part of ``n_tokens`` plus
        the fixed part of every prefill step it adds. The two are compared as
        whole first steps: the new turn's own step, whose fixed part is paid
        either way, is added to both sides, so that a saving small beside it
        (on a GPU an eager step is mostly fixed cost) does not count as a win.
        """
        if self.policy != "auto":
            return Choice(self.policy, f"restore_policy={self.policy!r}")
        fit = self.prefill.fit()
        restore_s = self.disk.predict(n_bytes)
        steps = 1 if not self.max_step_tokens else max(1, math.ceil(n_tokens / self.max_step_tokens))
        recompute_s = None if fit is None else fit[1] * n_tokens + fit[0] * (steps - 1)
        if fit is None or restore_s is None or recompute_s is None:
            return Choice("restore", "no measured " + ("disk bandwidth" if restore_s is None else "prefill rate")
                          + " yet", restore_s, recompute_s)
        in_steps = f" in {steps} steps" if steps > 1 else ""
        what = (f"reading {n_bytes / 1e6:.1f} MB is predicted to take {restore_s * 1e3:.0f} ms, "
                f"prefilling {n_tokens} tokens{in_steps} {recompute_s * 1e3:.0f} ms, "
                f"beside the turn's own step's {fit[0] * 1e3:.0f} ms")
        if (fit[0] + recompute_s) * RECOMPUTE_ADVANTAGE < fit[0] + restore_s:
            return Choice("recompute", f"recomputed instead of restored: {what}", restore_s, recompute_s)
        return Choice("restore", what, restore_s, recompute_s)
