"""Batched decode steps, compiled against uncompiled and stock transformers, at several batch sizes.

    python -m benchmarks.decode_batch --batches 1,2,3,4,6,8 --graphs 1,2,4,8 --context 1000

Two engines on the same weights, one after the other in this process: one
that runs the model as it is, one whose decode step is compiled for the batch
sizes ``--graphs`` (a batch smaller than a compiled size runs padded through
the next larger one; larger than all, as it is). On each, for each batch size
``B``, ``B`` sequences get ``--context`` tokens of KV written into the pool
(zeros: the cost of a step does not depend on the values) and then run
``--steps`` decode steps together; the figure is the median milliseconds per
step after the first ``--skip``. Before both, the stock model (transformers'
own attention and a DynamicCache) decodes ``B`` sequences of the same length
(``--no-peer`` leaves it out). Prints a markdown table and writes JSON with
``--out``.

On a GPU (``--device cuda``) the "compiled" engine replays CUDA graphs of
the decode step (:mod:`chatkv.cuda_graphs`) and each step is timed to the
end of its GPU work. ``--model random:smollm2`` builds SmolLM2-135M's shape
with random weights, for machines that have no copy of the model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import write_json


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"4,1,2,2"`` as ``(1, 2, 4)``: the distinct integers of a comma-separated list, ascending."""
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


def step_ms(engine: Any, batch: int, context: int, steps: int, skip: int) -> float:
    """Median milliseconds per decode step of ``batch`` sequences over ``context`` tokens each (on the loop)."""
    import torch

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
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                times.append(time.perf_counter() - started)
            return statistics.median(times[skip:]) * 1e3
        finally:
            for seq in seqs:
                engine.pool.discard(seq)

    return engine.call(job)


def transformers_step_ms(model: Any, batch: int, context: int, steps: int, skip: int) -> float:
    """Median milliseconds per decode step of the stock model (transformers'
    own attention, a DynamicCache) for ``batch`` sequences of ``context``
    tokens each, all of one length so that no padding is needed: the peer."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([[(i * 7 + b) % 5000 + 10 for i in range(context)] for b in range(batch)], device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        token = torch.full((batch, 1), 11, dtype=torch.long, device=device)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
    return statistics.median(times[skip:]) * 1e3


#: SmolLM2-135M-Instruct's shape (its config.json), for ``--model random:smollm2``.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                     max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)


def random_smollm2(dtype: Any, device: str) -> Any:
    """A :class:`chatkv.models.LoadedModel` of SmolLM2-135M's shape with random
    weights (the step's cost does not depend on them) and the tiny test tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from chatkv.models import LoadedModel
    from chatkv.testing import tiny_tokenizer

    config = AutoConfig.for_model("llama", **SMOLLM2_SHAPE)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return LoadedModel(model, tiny_tokenizer(), "SmolLM2-135M shape, random weights", "random", "decode-batch")


def load_benchmark_model(spec: str, device: str) -> Any:
    """The model a benchmark runs: ``spec`` (``"default"``, a model spec, or
    ``random:smollm2``: see :func:`random_smollm2`) on ``device``, in chatkv's
    dtype for that device (:func:`chatkv.hardware.resolve_dtype`)."""
    from chatkv.hardware import resolve_dtype
    from chatkv.models import load_model

    dtype = resolve_dtype(None, device)
    if spec == "random:smollm2":
        return random_smollm2(dtype, device)
    return load_model(None if spec == "default" else spec, dtype=dtype, device=device)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,3,4,6,8", help="decode batch sizes to time")
    p.add_argument("--graphs", default="1,2,4,8", help="batch sizes the compiled engine compiles")
    p.add_argument("--context", type=int, default=1000, help="tokens of KV per sequence")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="default", help="a model spec, or random:smollm2")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-peer", action="store_true", help="leave out the stock transformers decode")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from chatkv.config import EngineConfig
    from chatkv.engine import Engine

    batches, graphs = parse_sizes(args.batches), parse_sizes(args.graphs)
    loaded = load_benchmark_model(args.model, args.device)
    rows: dict[str, dict[int, float]] = {}
    compiled_steps: dict[int, int] = {}
    if not args.no_peer:  # first: an engine switches the model to chatkv's attention
        from chatkv.threads import in_passing_thread

        # In a thread that exits when done: its OpenMP pool goes with it. Run on the
        # main thread, that pool and the engine loop's together outnumber the cores,
        # and libgomp's throttled workers made chatkv's steps 1.5x to 2x slower
        # (chatkv/threads.py).
        rows["transformers"] = {b: in_passing_thread(transformers_step_ms, loaded.model, b, args.context,
                                                     args.steps, args.skip)
                                for b in batches}
    # A GPU's default pool is most of its memory: size it for the sequences timed here.
    blocks = 4 * max(batches) * (args.context + args.steps) // 16 + 1024 if args.device == "cuda" else None
    for name, config in (("uncompiled", EngineConfig(compile="off", num_blocks=blocks)),
                         ("compiled", EngineConfig(compile="on", compile_batch_sizes=graphs, compile_prefill=False,
                                                    num_blocks=blocks))):
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
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} threads"
    print(f"ms per decode step, {loaded.name}, {loaded.dtype}, {args.context} tokens of context per sequence, "
          f"{where}")
    print("| B | " + " | ".join(str(b) for b in batches) + " |")
    print("| --- |" + " ---: |" * len(batches))
    print("| uncompiled | " + " | ".join(f"{rows['uncompiled'][b]:.1f}" for b in batches) + " |")
    print("| compiled (graph) | " + " | ".join(
        f"{rows['compiled'][b]:.1f} ({used[b] if used[b] else 'none'})" for b in batches) + " |")
    print("| ratio | " + " | ".join(f"{rows['uncompiled'][b] / rows['compiled'][b]:.2f}x" for b in batches) + " |")
    if "transformers" in rows:
        print("| transformers (DynamicCache) | " + " | ".join(f"{rows['transformers'][b]:.1f}" for b in batches) + " |")
        print("| transformers / compiled | " + " | ".join(
            f"{rows['transformers'][b] / rows['compiled'][b]:.2f}x" for b in batches) + " |")
    write_json(args.out, {"model": loaded.name, "context": args.context, "threads": args.threads, "graphs": graphs,
                          "graph_used": used, "compiled_steps": compiled_steps, "ms_per_step": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
