"""Session restore from host memory vs re-prefill, on a 1B-parameter-shaped model.

Random weights (nothing needs to travel): a Llama with hidden 2048, 16 layers,
32 query / 8 KV heads, head dim 64, MLP 8192, bf16 on CUDA (about 1.2 B
parameters). For each history length it measures, with CUDA events:

* re-prefill: computing the whole history's KV, then the first new token;
* restore: moving the session's KV from pinned host memory into the block pool
  (side-stream copy), then the first new token; full precision and int8.

Prints a Markdown table (also written to ``$OUT/gpu_restore.md``). ``--dry-run``
runs the same code on the CPU with a tiny model. Needs torch, transformers and
triton, and chatkv installed (its storage imports SQLAlchemy; gpu_check.sh installs it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Appended, not prepended: an installed chatkv (whose chatkv.storage is the
# checkout's storage/ folder) comes first; the checkout's chatkv/ is the fallback.
sys.path.append(str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from chatkv.config import EngineConfig
    from chatkv.engine import Engine
    from chatkv.models import LoadedModel
    from chatkv.runner import StepInput
    from chatkv.sequence import Sequence
    from chatkv.testing import tiny_tokenizer
    from chatkv.offload import offload, reload

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if args.dry_run:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
        contexts = [64, 256]
        dtype = torch.float32
    else:
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=32000)
        contexts = [int(c) for c in args.contexts.split(",")]
        dtype = torch.bfloat16
    config = AutoConfig.for_model("llama", max_position_embeddings=max(contexts) + 64, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    loaded = LoadedModel(model, tiny_tokenizer(), "llama-1b-shaped", "random", "gpu-restore")
    block = 16
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * \
        torch.empty((), dtype=dtype).element_size()
    need_blocks = 2 * (max(contexts) + 64) // block + 8
    engine = Engine(loaded, EngineConfig(num_blocks=need_blocks, block_size=block,
                                         attention_backend="auto", max_prefill_tokens=4096))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    rows = []
    g = torch.Generator().manual_seed(1)
    for ctx in contexts:
        history = torch.randint(0, shape["vocab_size"], (ctx,), generator=g).tolist()
        new_token = [7]
        re_prefill, restore_fp, restore_i8 = [], [], []
        host_bytes = {}
        for _ in range(args.repeats):
            seq = Sequence(token_ids=history + new_token)

            def prefill_all() -> None:
                engine.prefill(seq)

            re_prefill.append(timed(prefill_all))
            seq.token_ids.pop()
            engine.call(lambda: engine.pool.truncate(seq, ctx))  # the session's KV covers the history only
            for scheme, sink in (("none", restore_fp), ("int8", restore_i8)):
                off = engine.call(lambda: offload(engine.pool, seq, scheme).to(torch.device("cpu")))
                host_bytes[scheme] = off.nbytes
                back = Sequence()

                def restore_and_step() -> None:
                    def run() -> None:  # on the engine's loop, which owns the pool
                        reload(engine.pool, back, off)
                        back.token_ids.append(new_token[0])
                        engine.runner.forward([StepInput(back, new_token)])
                        sync()
                    engine.call(run)

                sink.append(timed(restore_and_step))
                engine.call(lambda: engine.pool.release(back))
            engine.call(lambda: engine.pool.release(seq))
        med = statistics.median
        rows.append((ctx, med(re_prefill), med(restore_fp), med(restore_i8),
                     ctx * per_token, host_bytes["none"], host_bytes["int8"]))

    dev_name = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    lines = [
        f"## Session restore vs re-prefill ({dev_name}, {params / 1e9:.2f} B params, {dtype}, "
        f"backend {engine.backend.name})",
        "",
        "| history tokens | re-prefill + 1st token (ms) | restore fp from host + 1st token (ms) | speedup "
        "| restore int8 (ms) | speedup | KV bytes | host GB/s (fp) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ctx, rp, fp, i8, kv, hb, hq in rows:
        lines.append(f"| {ctx} | {rp * 1e3:.1f} | {fp * 1e3:.1f} | {rp / fp:.1f}x | {i8 * 1e3:.1f} | "
                     f"{rp / i8:.1f}x | {kv / 2**20:.1f} MiB | {hb / fp / 1e9:.1f} |")
    text = "\n".join(lines)
    print(text)
    out = args.out or (Path(os.environ["OUT"]) / "gpu_restore.md" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
