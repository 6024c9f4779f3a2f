"""A returning turn's prefill step: chatkv's compiled prefill graph, the model as it is, stock transformers.

    python -m benchmarks.prefill_step --context 1500 --tokens 8,21,51,120,400 --repeats 9

What a returning conversation waits for after its KV is back: one prefill
step of ``T`` new tokens (the new message and its template) over
``--context`` cached tokens, up to the first token's logits. First the
stock model (transformers' own SDPA attention, a ``DynamicCache`` holding
the context, ``logits_to_keep=1``) runs each ``T`` ``--repeats`` times, the
cache cropped back after each: the peer. Then one chatkv engine with the
compile on (:class:`chatkv.compile.PrefillGraph`, waited for) runs the same
steps over ``--context`` tokens of KV written into its pool (zeros: the
step's cost does not depend on the values), alternating between the
compiled graph and the model as it is, so that both see the same machine
state. Figures are median milliseconds per step (the first repeat of each
left out). Prints a markdown table and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import write_json


def _ids(start: int, n: int, step: int, vocab: int) -> list[int]:
    """``n`` token ids from ``start``, ``step`` apart, wrapped into ``[10, min(vocab, 5010))``."""
    span = min(vocab, 5010) - 10
    return [(start + i * step) % span + 10 for i in range(n)]


def transformers_prefill_ms(model: Any, context: int, tokens: int, repeats: int) -> float:
    """Median milliseconds of the stock model's prefill of ``tokens`` new tokens
    over a ``DynamicCache`` of ``context`` tokens (the peer), first repeat left out."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([_ids(0, context + tokens, 7, model.get_input_embeddings().num_embeddings)])
    times = []
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - started)
            cache.crop(-tokens)  # back to the context alone
    return statistics.median(times[1:]) * 1e3


def timed_step(runner: Any, seq: Any, new: list[int], context: int) -> float:
    """Seconds of one ``runner`` step of the ``new`` tokens appended to ``seq``,
    whose KV is then cut back to its first ``context`` tokens. Runs on the loop."""
    from chatkv.runner import StepInput

    seq.token_ids.extend(new)
    started = time.perf_counter()
    runner.forward([StepInput(seq, new)])
    seconds = time.perf_counter() - started
    runner.pool.truncate(seq, context)
    return seconds


def chatkv_prefill_ms(engine: Any, context: int, tokens: int, repeats: int) -> tuple[float, float, int]:
    """Median milliseconds of one chatkv prefill step of ``tokens`` tokens over
    ``context`` cached ones, through the engine's compiled prefill graph and
    through the model as it is (alternating, first repeat of each left out),
    and how many steps ran through the graph. Runs on the loop."""
    from chatkv.sequence import Sequence

    def job() -> tuple[float, float, int]:
        runner = engine.runner
        graph = runner.prefill_graph
        vocab = runner.model.get_input_embeddings().num_embeddings
        seq = Sequence(token_ids=[])
        times: dict[bool, list[float]] = {True: [], False: []}
        before = runner.compiled_prefills
        try:
            runner.write_placeholder_history(seq, _ids(0, context, 7, vocab))
            for rep in range(2 * repeats):
                compiled = rep % 2 == 0
                runner.prefill_graph = graph if compiled else None
                times[compiled].append(timed_step(runner, seq, _ids(rep, tokens, 3, vocab), context))
        finally:
            runner.prefill_graph = graph
            runner.pool.discard(seq)
        return (statistics.median(times[True][1:]) * 1e3, statistics.median(times[False][1:]) * 1e3,
                runner.compiled_prefills - before)

    return engine.call(job)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1500, help="cached tokens before the step")
    p.add_argument("--tokens", default="8,21,51,120,400", help="new tokens per step")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="default", help="a model spec, or random:smollm2")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be at least 2 (the first is left out)")
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.decode_batch import load_benchmark_model, parse_sizes
    from chatkv.config import EngineConfig
    from chatkv.engine import Engine
    from chatkv.threads import in_passing_thread

    sizes = parse_sizes(args.tokens)
    loaded = load_benchmark_model(args.model, "cpu")
    # The peer first: an engine switches the model to chatkv's attention. In a
    # thread that exits when done, so that its OpenMP pool goes with it (chatkv/threads.py).
    peer = {t: in_passing_thread(transformers_prefill_ms, loaded.model, args.context, t, args.repeats)
            for t in sizes}
    engine = Engine(loaded, EngineConfig(compile="on", max_prefill_tokens=max(2048, max(sizes))))
    try:
        engine.wait_warm()
        if engine.runner.prefill_graph is None:
            raise SystemExit("compiling the prefill step failed here (see the log)")
        rows = {t: chatkv_prefill_ms(engine, args.context, t, args.repeats) for t in sizes}
    finally:
        engine.close()
    print(f"ms per prefill step of T new tokens over {args.context} cached tokens, {loaded.name}, "
          f"{loaded.dtype}, {args.threads} threads, medians of {args.repeats - 1}")
    print("| T | " + " | ".join(str(t) for t in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    print("| chatkv, compiled prefill | " + " | ".join(f"{rows[t][0]:.1f}" for t in sizes) + " |")
    print("| chatkv, as it is | " + " | ".join(f"{rows[t][1]:.1f}" for t in sizes) + " |")
    print("| transformers (SDPA, DynamicCache) | " + " | ".join(f"{peer[t]:.1f}" for t in sizes) + " |")
    print("| as it is / compiled | " + " | ".join(f"{rows[t][1] / rows[t][0]:.2f}x" for t in sizes) + " |")
    print("| transformers / compiled | " + " | ".join(f"{peer[t] / rows[t][0]:.2f}x" for t in sizes) + " |")
    write_json(args.out, {"model": loaded.name, "dtype": str(loaded.dtype), "context": args.context,
                          "threads": args.threads, "repeats": args.repeats,
                          "ms": {"compiled": {t: rows[t][0] for t in sizes},
                                 "uncompiled": {t: rows[t][1] for t in sizes}, "transformers": peer},
                          "compiled_steps": {t: rows[t][2] for t in sizes}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
