"""Throughput with N active sessions: the hook for when the engine batches.

The issue asks for total tokens/s and mean time to first token with 1, 4 and 16
sessions active at once. chatkv's engine answers one sequence per ``generate``
call today (a packed multi-sequence forward exists in ``ModelRunner.forward``,
but no scheduler drives it), so :func:`measure_throughput` reports why it cannot
run. When continuous batching lands, fill in :func:`measure_throughput` with the
engine's batched entry point; the report renders whatever dict it returns.
"""

from __future__ import annotations

from typing import Any

#: Session counts the report asks for.
DEFAULT_SESSIONS = (1, 4, 16)

#: The engine method whose presence means continuous batching exists.
BATCH_ENTRY_POINT = "step"


def measure_throughput(engine: Any, points: list[Any], new_tokens: int,
                       sessions: tuple[int, ...] = DEFAULT_SESSIONS) -> dict[str, Any]:
    """Total generated tokens/s and mean TTFT with ``n`` sessions active, for each ``n``.

    Returns:
        ``{"available": False, "reason": ...}`` until the engine has a batched
        scheduler; then ``{"available": True, "rows": [{"sessions", "tokens_per_s",
        "mean_ttft_s"}, ...]}``.
    """
    if not hasattr(engine, BATCH_ENTRY_POINT):
        return {"available": False,
                "reason": "the engine has no continuous batching yet (Engine.generate runs one "
                          "sequence at a time); benchmarks/throughput.py is the hook"}
    raise NotImplementedError("wire Engine.step into measure_throughput when batching lands")
