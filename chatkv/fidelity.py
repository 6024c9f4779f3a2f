"""Measuring what a KV quantization scheme costs a model, through the real path.

:func:`measure` prefills a conversation at full precision, sends a copy of
its KV through the quantized tier (offload with the scheme, reload), then
teacher-forces the same continuation on both and compares the next-token
distributions: top-1 agreement and mean KL divergence. :func:`passes_floor`
caches the result per model fingerprint under ``<home>/fidelity.json`` so the
tier manager measures each scheme once per model.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from chatkv.config import chatkv_home
from chatkv.errors import OutOfBlocksError
from chatkv.offload import offload, reload
from chatkv.runner import StepInput
from chatkv.sequence import Sequence
from chatkv.storage import StorageWriteError
from chatkv.storage.chunkfile import atomic_write

if TYPE_CHECKING:
    from chatkv.engine import Engine

#: A short built-in conversation for calibration (when no workload is given).
CALIBRATION: list[dict[str, str]] = [
    {"role": "system", "content": "You are a helpful assistant who explains things clearly."},
    {"role": "user", "content": "What does a database index do, and why can it make writes slower?"},
    {"role": "assistant", "content": (
        "An index is a separate data structure, usually a B-tree, that keeps a sorted copy of one or "
        "more columns with pointers back to the rows. A query that filters on those columns can walk "
        "the tree instead of scanning the whole table. Every insert, update or delete must also update "
        "each index on the table, so writes do more work and take more space.")},
    {"role": "user", "content": "So when should I avoid adding one?"},
    {"role": "assistant", "content": (
        "Avoid an index on a column that is rarely used in filters or joins, on a small table that is "
        "cheap to scan anyway, on a column with very few distinct values, and on tables that take far "
        "more writes than reads. Measure with the query planner before and after: an index that the "
        "planner never chooses only costs you.")},
    {"role": "user", "content": "How do I find slow queries in PostgreSQL in the first place?"},
    {"role": "assistant", "content": (
        "Turn on the pg_stat_statements extension: it records, for every normalized query, how often it "
        "ran, the total and mean execution time, and the rows it returned. Sort by total time to find the "
        "queries that cost the most overall, and by mean time to find the ones that are slow each time. "
        "For a single query, run EXPLAIN (ANALYZE, BUFFERS) to see the plan the planner chose, the time "
        "spent in each step, and whether it read from the cache or from disk. Look for sequential scans "
        "on large tables, nested loops over many rows, and estimates that are far from the actual row "
        "counts, which usually means the statistics are stale and ANALYZE should be run. You can also set "
        "log_min_duration_statement to log every query slower than a threshold, such as 500 milliseconds, "
        "and review the log during busy hours. Fix the worst offender first, measure again, and repeat.")},
]

_LOCK = threading.Lock()
log = logging.getLogger(__name__)


@dataclass
class FidelityResult:
    """Teacher-forced agreement of quantized-tier KV with full precision."""

    scheme: str
    top1_agreement: float
    mean_kl: float
    tokens: int


def measure(engine: "Engine", scheme: str, conversation: list[dict[str, str]] | None = None,
            max_forced: int = 512) -> FidelityResult:
    """Compare next-token predictions over the last assistant turn of
    ``conversation`` with its history's KV at full precision vs through ``scheme``.

    The whole reply is teacher-forced in one forward pass per copy. Uses two
    temporary sequences in the engine's pool (released before return).

    Runs on the engine's loop (between forward steps), through the same
    runner entry as every turn.

    Raises:
        OutOfBlocksError: the pool cannot hold two copies of the conversation.
    """
    return engine.call(lambda: _measure(engine, scheme, conversation, max_forced), f"fidelity {scheme}")


def _measure(engine: "Engine", scheme: str, conversation: list[dict[str, str]] | None,
             max_forced: int) -> FidelityResult:
    messages = list(conversation or CALIBRATION)
    assert messages[-1]["role"] == "assistant", "the conversation must end with an assistant turn"
    pool = engine.pool
    # Two copies must fit the pool, and one the context window: drop the oldest
    # exchanges (keeping a system prompt) until they do.
    budget = min(engine.max_context - 1, (pool.num_available // 2 - 1) * pool.block_size)
    while True:
        prefix = engine.encode_chat(messages[:-1], True)
        full = engine.encode_chat(messages, False)
        forced = full[len(prefix):][:max_forced]
        first = 1 if messages[0]["role"] == "system" else 0
        if len(prefix) + len(forced) <= budget or len(messages) - first <= 2:
            break
        del messages[first : first + 2]
    if full[: len(prefix)] != prefix or not forced:
        raise ValueError("the chat template does not extend the history with the assistant turn")
    forced = forced[: max(0, budget - len(prefix))]
    if len(forced) < 16:
        raise OutOfBlocksError("the calibration conversation does not fit the pool or the context window")
    exact = Sequence(token_ids=list(prefix))
    lossy = Sequence()
    try:
        engine.runner.forward([StepInput(exact, list(prefix))])
        reload(pool, lossy, offload(pool, exact, scheme))
        # Position i predicts forced[i + 1]; the prefix's last logits predict forced[0].
        exact.token_ids += forced
        lossy.token_ids += forced
        a = engine.runner.forward([StepInput(exact, forced)], all_logits=True)[:-1]
        b = engine.runner.forward([StepInput(lossy, forced)], all_logits=True)[:-1]
        agree = int((a.argmax(-1) == b.argmax(-1)).sum())
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl = float((la.exp() * (la - lb)).sum(-1).sum())
        n = a.shape[0]
        return FidelityResult(scheme, agree / n, kl / n, n)
    finally:
        pool.release(exact)
        pool.release(lossy)


def _cache_path() -> Any:
    return chatkv_home() / "fidelity.json"


def cached_results(fingerprint: str) -> dict[str, FidelityResult]:
    """Fidelity measured earlier for the model with ``fingerprint``, by scheme."""
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: FidelityResult(**v) for k, v in data.get(fingerprint, {}).items()}


def record(fingerprint: str, result: FidelityResult) -> None:
    """Store a measurement for the model with ``fingerprint``; it replaces the
    stored one for that scheme only if it covers at least as many tokens (a
    report over real conversations outranks the built-in calibration)."""
    path = _cache_path()
    with _LOCK:
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            data = {}
        known = data.setdefault(fingerprint, {})
        old = known.get(result.scheme)
        if old is not None and old.get("tokens", 0) > result.tokens:
            return
        known[result.scheme] = asdict(result)
        try:
            atomic_write(path, json.dumps(data, indent=1).encode())
        except StorageWriteError as exc:  # an unwritable home only costs measuring again next time
            log.warning("could not record the fidelity measurement in %s: %s", path, exc)


def passes_floor(engine: "Engine", scheme: str, floor: float) -> bool:
    """True if ``scheme``'s top-1 agreement for this model is at least ``floor``.

    Uses the stored measurement with the most tokens for this model's
    fingerprint (``python -m benchmarks.fidelity`` records one over real
    ShareGPT conversations); without one, measures the built-in calibration
    conversation once (see :func:`measure`) and stores it. A floor of 0 or
    less passes without measuring; a scheme that cannot be measured (pool too
    small) does not pass.
    """
    if floor <= 0:
        return True
    fp = engine.loaded.fingerprint
    known = cached_results(fp)
    if scheme not in known:
        try:
            result = measure(engine, scheme)
        except (OutOfBlocksError, ValueError):
            return False
        record(fp, result)
        known = cached_results(fp) or {scheme: result}
    return known.get(scheme, FidelityResult(scheme, 0.0, 0.0, 0)).top1_agreement >= floor
