"""Decode-attention bandwidth check for chatkv's fused paged kernels (issue 8).

Times one decode step of attention on a Llama-3-8B-shaped layer (32 query
heads, 8 KV heads, head dim 128, bf16, block size 16) for batch sizes 1..64 and
contexts 1k..32k, for the Triton kernel, the ``torch`` backend and FlexAttention,
and reports the achieved K/V read bandwidth as a fraction of a measured
device-to-device copy. Prints a Markdown table and writes it to ``$OUT`` (or
``--out``). Needs torch (+ triton for the fused kernel); no network, no SQLAlchemy.

``--dry-run`` runs the same logic on the CPU with tiny shapes through Triton's
interpreter, to check the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Shape:
    """The benchmark's model layer and sweep."""

    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    batches: list[int]
    contexts: list[int]


GPU_SHAPE = Shape(32, 8, 128, 16, [1, 2, 4, 8, 16, 32, 64], [1024, 2048, 4096, 8192, 16384, 32768])
DRY_SHAPE = Shape(4, 2, 16, 4, [1, 3], [8, 40])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--out", type=Path, default=None, help="Markdown output (default: $OUT/gpu_check.md)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this")
    p.add_argument("--flex-budget-s", type=float, default=150.0,
                   help="stop timing FlexAttention (compiles per batch size) after this")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the full sweep)")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths (default: the full sweep)")
    return p.parse_args(argv)


args = parse_args()
if args.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
# Appended, not prepended: an installed chatkv (whose chatkv.storage is the
# checkout's storage/ folder) comes first; the checkout's chatkv/ is the fallback.
sys.path.append(str(ROOT))

import torch  # noqa: E402

from chatkv.attention.base import AttentionMetadata  # noqa: E402
from chatkv.attention.flex_backend import FlexBackend  # noqa: E402
from chatkv.attention.torch_backend import TorchBackend  # noqa: E402
from chatkv.attention.triton_backend import TritonBackend  # noqa: E402


class Timer:
    """Median wall time of a callable; CUDA events on the GPU, with an L2 flush before each run."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.device = device
        self.iters = iters
        # Larger than any L2 cache, so small cases are not served from it.
        self.flush = torch.empty(256 << 20 if device.type == "cuda" else 1 << 20, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], object], warmup: int = 2) -> float:
        """Milliseconds per call (median of ``iters``)."""
        for _ in range(warmup):
            fn()
        times: list[float] = []
        if self.device.type == "cuda":
            events = []
            for _ in range(self.iters):
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting its read and its write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).fill_(1)  # [nbytes]
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def make_step(
    kv: torch.Tensor, order: torch.Tensor, batch: int, context: int, max_blocks: int
) -> AttentionMetadata:
    """Decode metadata: ``batch`` sequences of ``context`` tokens on scattered blocks."""
    block_size = kv.shape[3]
    per_seq = -(-context // block_size)
    device = kv.device
    tables = torch.zeros((batch, max_blocks), dtype=torch.int32, device=device)  # [B, max_blocks]
    tables[:, :per_seq] = order[: batch * per_seq].view(batch, per_seq)
    assert tables.shape == (batch, max_blocks)
    return AttentionMetadata(
        kv=kv,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens_list=[context] * batch,
        query_lens_list=[1] * batch,
        max_query_len=1,
    )


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def main() -> int:
    started = time.monotonic()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    shape = DRY_SHAPE if args.dry_run else GPU_SHAPE
    if args.batches:
        shape = dataclasses.replace(shape, batches=[int(b) for b in args.batches.split(",")])
    if args.contexts:
        shape = dataclasses.replace(shape, contexts=[int(c) for c in args.contexts.split(",")])
    dtype = torch.bfloat16
    esize = torch.finfo(dtype).bits // 8
    timer = Timer(device, 3 if args.dry_run else args.iters)
    torch.manual_seed(0)
    if device.type == "cuda":
        import torch._dynamo as dynamo

        # FlexAttention recompiles per batch size; without this dynamo falls back to eager.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
        name = torch.cuda.get_device_name(device)
    else:
        name = "CPU (dry run, Triton interpreter)"

    copy_bps = copy_bandwidth(timer, (1 << 30) if device.type == "cuda" else (8 << 20))
    print(f"# chatkv decode attention on {name}\n")
    print(f"torch {torch.__version__}; device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + write)\n")

    max_blocks = -(-max(shape.contexts) // shape.block_size)
    num_blocks = max(shape.batches) * max_blocks + 1
    kv = torch.randn(  # one layer of the pool: [L=1, 2, NB, BS, Hkv, D]
        (1, 2, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim), dtype=dtype, device=device
    )
    assert kv.shape == (1, 2, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache, v_cache = kv[0, 0], kv[0, 1]
    order = torch.randperm(num_blocks - 1, device=device).to(torch.int32) + 1  # block 0 stays padding
    scale = shape.head_dim**-0.5

    backends: dict[str, object] = {"torch": TorchBackend()}
    if TritonBackend.is_available(device):
        backends["triton"] = TritonBackend()
    else:
        print("triton: unavailable (not installed?)\n")
    use_flex = not args.no_flex and FlexBackend.is_available(device)
    if use_flex:
        backends["flex"] = FlexBackend()
    flex_error: str | None = None

    header = (
        "| batch | context | triton ms | triton BW | torch ms | torch BW | flex ms | flex BW "
        "| triton vs torch | max err triton | max err flex |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    print(lines[0])
    print(lines[1])
    results: dict[tuple[int, int], dict[str, float]] = {}
    for batch in shape.batches:
        for context in shape.contexts:
            if time.monotonic() - started > args.budget_s:
                print(f"(time budget of {args.budget_s:.0f} s spent: stopped before batch {batch}, context {context})")
                break
            meta = make_step(kv, order, batch, context, max_blocks)
            query = torch.randn((batch, shape.q_heads, shape.head_dim), dtype=dtype, device=device)  # [B, Hq, D]
            kv_bytes = 2 * batch * context * shape.kv_heads * shape.head_dim * esize
            row: dict[str, float] = {}
            outs: dict[str, torch.Tensor] = {}
            for bname, backend in backends.items():
                if bname == "flex" and (flex_error or time.monotonic() - started > args.flex_budget_s):
                    continue

                def step(b: object = backend) -> torch.Tensor:
                    return b.forward(query, k_cache, v_cache, meta, scale)  # type: ignore[attr-defined]

                try:
                    outs[bname] = step()
                    ms = timer(step)
                except Exception as exc:  # noqa: BLE001 - a failing backend is reported, not fatal
                    if bname != "flex":
                        raise
                    flex_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    print(f"(flex failed, not timed further: {flex_error})")
                    continue
                row[f"{bname}_ms"] = ms
                row[f"{bname}_frac"] = kv_bytes / (ms * 1e-3) / copy_bps
            ref = outs["torch"].float()
            for bname in ("triton", "flex"):
                if bname in outs:
                    row[f"{bname}_err"] = (outs[bname].float() - ref).abs().max().item()
            results[(batch, context)] = row
            speedup = row["torch_ms"] / row["triton_ms"] if "triton_ms" in row else None
            line = (
                f"| {batch} | {context} | {fmt(row.get('triton_ms'), '.3f')} | {fmt(row.get('triton_frac'), '.0%')} "
                f"| {fmt(row.get('torch_ms'), '.3f')} | {fmt(row.get('torch_frac'), '.0%')} "
                f"| {fmt(row.get('flex_ms'), '.3f')} | {fmt(row.get('flex_frac'), '.0%')} "
                f"| {fmt(speedup, '.1f')}x | {fmt(row.get('triton_err'), '.1e')} | {fmt(row.get('flex_err'), '.1e')} |"
            )
            lines.append(line)
            print(line, flush=True)
        else:
            continue
        break

    summary = ["", "BW = K/V bytes read per step / time, as a fraction of the copy bandwidth above."]
    if flex_error:
        summary.append(f"FlexAttention failed: {flex_error}")
    longest, goal_b, goal_c = max(shape.contexts), 16, 8192
    long_fracs = [r["triton_frac"] for (b, c), r in results.items() if c == longest and "triton_frac" in r]
    if long_fracs:
        best = max(long_fracs)
        summary.append(
            f"Goal 1, triton at {longest} context reaches >= 70% of copy bandwidth: best {best:.0%} "
            f"({'met' if best >= 0.70 else 'NOT met'})."
        )
    r = results.get((goal_b, goal_c))
    if r and "triton_ms" in r:
        sp = r["torch_ms"] / r["triton_ms"]
        summary.append(
            f"Goal 2, triton >= 2x the torch backend at batch {goal_b}, {goal_c} context: "
            f"{sp:.1f}x ({'met' if sp >= 2 else 'NOT met'})."
        )
    errs = [r["triton_err"] for r in results.values() if "triton_err" in r]
    if errs:
        summary.append(f"Largest |triton - torch| over all cases: {max(errs):.2e} (bf16).")
    summary.append(f"Total time {time.monotonic() - started:.0f} s.")
    print("\n".join(summary))

    out_path = args.out
    if out_path is None and os.environ.get("OUT"):
        out_path = Path(os.environ["OUT"]) / "gpu_check.md"
    if out_path is not None:
        text = [f"# chatkv decode attention on {name}", "",
                f"torch {torch.__version__}; device-to-device copy: {copy_bps / 1e9:.0f} GB/s", "",
                *lines, *summary, ""]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text("\n".join(text))
        print(f"\nwrote {out_path}")
    bad = [e for e in errs if e > 5e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
