"""Batched decode steps, compiled against uncompiled, at several batch sizes.

    python -m benchmarks.decode_batch --batches 1,2,3,4,6,8 --graphs 1,2,4,8 --context 1000

Two engines on the same weights, one after the other in this process: one
that runs the model as it is, one whose decode step is compiled for the batch
sizes ``--graphs`` (a batch smaller than a compiled size runs padded through
the next larger one; larger than all, as it is). On each, for each batch size
``B``, ``B`` sequences get ``--context`` tokens of KV written into the pool
(zeros: the cost of a step does not depend on the values) and then run
``--steps`` decode steps together; the figure is the median milliseconds per
step after the first ``--skip``. Prints a markdown table and writes JSON with
``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import write_json


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


def step_ms(engine: Any, batch: int, context: int, steps: int, skip: int) -> float:
    """Median milliseconds per decode step of ``batch`` sequences over ``context`` tokens each (on the loop)."""
    from chatkv.runner import StepInput
    from chatkv.sequence import Sequence

    def job() -> float:
        seqs = []
        try:
            for b in range(batch):
                seq = Sequence(token_ids=[])
                engine.runner.write_placeholder_history(seq, [(i * 7 + b) % 5000 + 10 for i in range(context)])
                seqs.append(seq)
            times = []
            for _ in range(steps):
                for seq in seqs:
                    seq.token_ids.append(11)
                started = time.perf_counter()
                engine.runner.forward([StepInput(seq, seq.token_ids[-1:]) for seq in seqs])
                times.append(time.perf_counter() - started)
            return statistics.median(times[skip:]) * 1e3
        finally:
            for seq in seqs:
                engine.pool.discard(seq)

    return engine.call(job)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,3,4,6,8", help="decode batch sizes to time")
    p.add_argument("--graphs", default="1,2,4,8", help="batch sizes the compiled engine compiles")
    p.add_argument("--context", type=int, default=1000, help="tokens of KV per sequence")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from chatkv.config import EngineConfig
    from chatkv.engine import Engine
    from chatkv.hardware import resolve_dtype
    from chatkv.models import load_model

    batches, graphs = _sizes(args.batches), _sizes(args.graphs)
    loaded = load_model(args.model, dtype=resolve_dtype(None))
    rows: dict[str, dict[int, float]] = {}
    compiled_steps: dict[int, int] = {}
    for name, config in (("uncompiled", EngineConfig(compile="off")),
                         ("compiled", EngineConfig(compile="on", compile_batch_sizes=graphs))):
        engine = Engine(loaded, config)
        try:
            engine.wait_warm()
            if name == "compiled" and engine.compiled.result() != len(graphs):
                raise SystemExit("compiling the decode step failed here (see the log)")
            rows[name] = {}
            for b in batches:
                before = engine.runner.compiled_steps
                rows[name][b] = step_ms(engine, b, args.context, args.steps, args.skip)
                if name == "compiled":
                    compiled_steps[b] = engine.runner.compiled_steps - before
        finally:
            engine.close()
    used = {b: min((g for g in graphs if g >= b), default=None) for b in batches}
    print(f"ms per decode step, {loaded.name}, {args.context} tokens of context per sequence, {args.threads} threads")
    print("| B | " + " | ".join(str(b) for b in batches) + " |")
    print("| --- |" + " ---: |" * len(batches))
    print("| uncompiled | " + " | ".join(f"{rows['uncompiled'][b]:.1f}" for b in batches) + " |")
    print("| compiled (graph) | " + " | ".join(
        f"{rows['compiled'][b]:.1f} ({used[b] if used[b] else 'none'})" for b in batches) + " |")
    print("| ratio | " + " | ".join(f"{rows['uncompiled'][b] / rows['compiled'][b]:.2f}x" for b in batches) + " |")
    write_json(args.out, {"model": loaded.name, "context": args.context, "threads": args.threads, "graphs": graphs,
                          "graph_used": used, "compiled_steps": compiled_steps, "ms_per_step": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
