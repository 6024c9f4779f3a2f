"""bfloat16 attention on the CPU: SDPA's flash kernel against chatkv's two products.

    python -m benchmarks.attention_paths
    python -m benchmarks.attention_paths --contexts 500,1000,2000,4000 --tokens 1,4,22,51 --agreement 12

Three measurements, each interleaving the two paths in one process so a noisy
neighbour hits both alike:

"products" here means every row by products: the engine's threshold
(:data:`chatkv.attention.torch_backend.PRODUCTS_FROM_POSITION`, below which
rows go through SDPA) is set to 0 for the run, since these figures are what
place it.

1. **The attention operator alone.** :func:`chatkv.attention.torch_backend.paged_attention_reference`
   for one sequence of ``T`` new tokens over ``L`` cached ones (SmolLM2's
   shape: 9 query heads, 3 KV heads, head dimension 64, blocks of 16 in a
   pool), with ``products`` off (SDPA) and on, alternating call by call;
   median microseconds per layer.
2. **A whole step.** One engine on the default model (bfloat16, compiled
   steps) runs a step of ``T`` tokens over ``L`` cached ones, its backend's
   ``products`` switched step by step; median milliseconds. Decode steps
   (``T=1``) keep their token, so each runs over one key more than the last,
   as a reply's do; longer steps are cut back to ``L`` after each.
3. **Agreement** (``--agreement N``, 0 skips it). The products compute
   transformers' eager attention (``tests/test_attention.py`` checks it bit
   for bit), so the stock model in bfloat16 with ``eager`` attention stands
   for them and with ``sdpa`` for SDPA's path. ``N`` ShareGPT conversations
   are teacher-forced through both and through float32; on every assistant
   reply token, each one's top-1 is compared with float32's.

Prints Markdown tables; ``--out`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.measure import write_json


def _alternate(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls alternating; the first round left out."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats + 1):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def operator_us(contexts: tuple[int, ...], tokens: tuple[int, ...], repeats: int) -> dict[int, dict[int, dict]]:
    """Median microseconds of one layer's attention by SDPA and by products, per ``L`` and ``T``."""
    from chatkv.attention.torch_backend import paged_attention_reference

    torch.manual_seed(0)
    block, kv_heads, heads, dim = 16, 3, 9, 64
    result: dict[int, dict[int, dict]] = {}
    for context in contexts:
        blocks = -(-context // block)
        k_cache = torch.randn(blocks + 1, block, kv_heads, dim, dtype=torch.bfloat16)
        v_cache = torch.randn(blocks + 1, block, kv_heads, dim, dtype=torch.bfloat16)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        result[context] = {}
        for t in tokens:
            q = torch.randn(t, heads, dim, dtype=torch.bfloat16)

            def run(products: bool) -> Callable[[], Any]:
                return lambda: paged_attention_reference(q, k_cache, v_cache, table, [context], [t], dim ** -0.5,
                                                         None, [0], {}, products)
            for _ in range(10):  # oneDNN builds a kernel per new shape
                run(False)()
                run(True)()
            got = _alternate({"sdpa": run(False), "products": run(True)}, repeats)
            result[context][t] = {name: s * 1e6 for name, s in got.items()}
    return result


def step_ms(engine: Any, contexts: tuple[int, ...], tokens: tuple[int, ...], repeats: int) -> dict[int, dict[int, dict]]:
    """Median milliseconds of one engine step of ``T`` tokens over ``L`` cached
    ones, the backend's ``products`` off and on, alternating step by step. Runs on the loop."""
    from benchmarks.prefill_step import _ids, timed_step
    from chatkv.sequence import Sequence

    def job() -> dict[int, dict[int, dict]]:
        runner = engine.runner
        backend = runner.backend
        vocab = runner.model.get_input_embeddings().num_embeddings
        result: dict[int, dict[int, dict]] = {}
        before = backend.products
        try:
            for context in contexts:
                seq = Sequence(token_ids=[])
                runner.write_placeholder_history(seq, _ids(0, context, 7, vocab))
                result[context] = {}
                for t in tokens:
                    times: dict[str, list[float]] = {"sdpa": [], "products": []}
                    for rep in range(2 * (repeats + 1)):
                        name = "products" if rep % 2 else "sdpa"
                        backend.products = name == "products"
                        # A decode step keeps its token, so the next one runs over one
                        # key more, as in a reply (a new length costs oneDNN a new
                        # kernel where the products have not padded it away); other
                        # steps are cut back to the context.
                        keep = context + rep + 1 if t == 1 else context
                        times[name].append(timed_step(runner, seq, _ids(rep, t, 3, vocab), keep))
                    runner.pool.truncate(seq, context)
                    result[context][t] = {n: statistics.median(v[1:]) * 1e3 for n, v in times.items()}
                runner.pool.discard(seq)
        finally:
            backend.products = before
        return result

    return engine.call(job)


def agreement(n: int, max_tokens: int) -> dict[str, Any]:
    """Top-1 agreement with float32 of the default model in bfloat16 with SDPA and
    with eager attention (the products' arithmetic), on ``n`` ShareGPT conversations."""
    from benchmarks.fidelity import conversation_turns
    from benchmarks.sharegpt import load_conversations
    from chatkv.models import load_model

    loaded = load_model(dtype=torch.float32)
    fp32 = loaded.model
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    same = {"sdpa": 0, "products": 0, "sdpa_vs_products": 0}
    total = used = 0
    for conv in load_conversations(n=n * 3, seed=0, min_turns=4):
        got = conversation_turns(loaded.tokenizer, conv, max_tokens)
        if got is None:
            continue
        ids, turns = got
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = fp32(x).logits[0].argmax(-1)
            bf16.set_attn_implementation("sdpa")
            sdpa = bf16(x).logits[0].float().argmax(-1)
            bf16.set_attn_implementation("eager")
            products = bf16(x).logits[0].float().argmax(-1)
        for t in turns:
            rows = slice(t.header - 1, t.end - 1)
            same["sdpa"] += int((sdpa[rows] == ref[rows]).sum())
            same["products"] += int((products[rows] == ref[rows]).sum())
            same["sdpa_vs_products"] += int((sdpa[rows] == products[rows]).sum())
            total += t.end - t.header
        used += 1
        if used >= n:
            break
    return {"conversations": used, "reply_tokens": total,
            **{f"top1_{k}": v / max(total, 1) for k, v in same.items()}}


def _table(title: str, data: dict[int, dict[int, dict]], tokens: tuple[int, ...], unit: str) -> None:
    print(f"\n{title}\n")
    print("| L (cached) | " + " | ".join(f"T={t}: SDPA | products | ratio" for t in tokens) + " |")
    print("| ---: |" + " ---: | ---: | ---: |" * len(tokens))
    for context, row in data.items():
        cells = [f"{row[t]['sdpa']:.{unit}f} | {row[t]['products']:.{unit}f} | "
                 f"{row[t]['products'] / row[t]['sdpa']:.2f}x" for t in tokens]
        print(f"| {context} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="500,1000,2000,4000", help="cached tokens L")
    p.add_argument("--tokens", default="1,4,22,51", help="new tokens T per step")
    p.add_argument("--repeats", type=int, default=40, help="calls per path (operator)")
    p.add_argument("--step-repeats", type=int, default=8, help="steps per path (whole step)")
    p.add_argument("--agreement", type=int, default=12, help="ShareGPT conversations (0: skip)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from benchmarks.decode_batch import parse_sizes
    from chatkv.allocator import tune_malloc
    from chatkv.config import EngineConfig
    from chatkv.engine import Engine
    from chatkv.models import load_model
    from chatkv.threads import in_passing_thread

    tune_malloc()  # as an engine does: a step's buffers reuse freed memory
    from chatkv.attention import torch_backend

    torch_backend.PRODUCTS_FROM_POSITION = 0  # "products": every row (see the module docstring)
    contexts, tokens = parse_sizes(args.contexts), parse_sizes(args.tokens)
    # In threads that exit when done, so that their OpenMP pools go with them
    # before the engine's loop starts its own (chatkv/threads.py).
    ops = in_passing_thread(operator_us, contexts, tokens, args.repeats)
    _table("One layer's attention, microseconds (medians)", ops, tokens, "0")
    agree = in_passing_thread(agreement, args.agreement, args.max_tokens) if args.agreement else None
    loaded = load_model(dtype=torch.bfloat16)
    engine = Engine(loaded, EngineConfig(compile="on", cpu_attention="auto"))
    try:
        engine.wait_warm()
        steps = step_ms(engine, contexts, tokens, args.step_repeats)
    finally:
        engine.close()
    _table(f"A whole step of {loaded.name} in bfloat16, ms (medians)", steps, tokens, "1")
    if agree is not None:
        print(f"\nTeacher-forced on {agree['reply_tokens']} reply tokens of {agree['conversations']} ShareGPT "
              f"conversations, top-1 equal to float32's: SDPA {100 * agree['top1_sdpa']:.2f}%, products "
              f"{100 * agree['top1_products']:.2f}%; SDPA's equal to the products' on "
              f"{100 * agree['top1_sdpa_vs_products']:.2f}%.")
    write_json(args.out, {"threads": args.threads, "operator_us": ops, "step_ms": steps, "agreement": agree})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
