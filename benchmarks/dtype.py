"""bfloat16 against float32 for the default model: speed through chatkv, and agreement on real replies.

Two measurements, same weights, same process, interleaved (fp32, bf16, fp32,
bf16, ...) so a noisy neighbour hits both alike:

1. **Speed through chatkv.** For each dtype an :class:`~chatkv.engine.Engine`
   (``persist=False`` sessions) prefills a ShareGPT history of about
   ``--prefill-tokens`` tokens from scratch (time to first token of a fresh
   session), then decodes ``--decode-tokens`` tokens (``ignore_eos``);
   medians of ``--repeats``.
2. **Agreement.** For ``--n`` ShareGPT conversations (cut to
   ``--max-tokens``), the whole templated conversation is teacher-forced
   through the stock model in each dtype; on every assistant-reply token,
   bf16's top-1 is compared with fp32's (the measure the KV fidelity
   benchmark uses), and so is whether fp32's top-1 is within bf16's top-5.

Prints a Markdown table with the ratios; ``--out`` also writes JSON.

Usage::

    python -m benchmarks.dtype
    python -m benchmarks.dtype --n 20 --repeats 5 --out benchmarks/out/dtype.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.fidelity import conversation_turns
from benchmarks.measure import write_json
from benchmarks.sharegpt import load_conversations
from chatkv.hardware import cpu_has_fast_bf16

DTYPES = (("float32", torch.float32), ("bfloat16", torch.bfloat16))


def _history(tokenizer: Any, target_tokens: int) -> list[dict]:
    """The first ShareGPT history (whole turns, ending in a user turn) of at least
    0.8x and at most ``target_tokens`` template tokens."""
    from chatkv.models import encode_chat

    for conv in load_conversations(n=500, seed=1, min_turns=4):
        msgs: list[dict] = []
        for m in conv:
            if m["role"] == "user" and len(encode_chat(tokenizer, msgs + [m])) > target_tokens:
                break
            msgs.append(m)
        while msgs and msgs[-1]["role"] != "user":
            msgs.pop()
        if msgs and len(encode_chat(tokenizer, msgs)) >= 0.8 * target_tokens:
            return msgs
    raise SystemExit(f"no ShareGPT history of about {target_tokens} tokens")


def time_turns(engines: dict[str, Any], history: list[dict], decode_tokens: int, repeats: int) -> dict[str, dict]:
    """Per dtype: median time to first token of a fresh prefill of ``history``, and decode tokens/s.

    Each round starts with its own system message, so no round finds another's
    blocks in the prefix cache: every prefill is from scratch.
    """
    from chatkv import Chat

    ttft: dict[str, list[float]] = {k: [] for k in engines}
    tps: dict[str, list[float]] = {k: [] for k in engines}
    prompt_tokens = 0
    for r in range(repeats + 1):  # round 0 warms each engine up and is not counted
        for name, engine in engines.items():
            chat = Chat(f"bench-{name}-{r}", engine=engine, persist=False, max_new_tokens=decode_tokens,
                        ignore_eos=True)
            for _ in chat.stream_complete([{"role": "system", "content": f"Round {r}."}, *history]):
                pass
            stats = chat.last_stats
            chat.close()
            assert stats is not None and stats.reused_tokens == 0, "a timed prefill reused cached KV"
            prompt_tokens = stats.prompt_tokens
            if r == 0:
                continue
            ttft[name].append(stats.ttft_s or float("nan"))
            if stats.decode_s and len(stats.token_ids) > 1:
                tps[name].append((len(stats.token_ids) - 1) / stats.decode_s)
    return {name: {"prompt_tokens": prompt_tokens, "ttft_s": statistics.median(ttft[name]),
                   "decode_tok_s": statistics.median(tps[name]) if tps[name] else float("nan"),
                   "ttft_runs_s": ttft[name]} for name in engines}


def agreement(models: dict[str, Any], tokenizer: Any, n: int, max_tokens: int) -> dict[str, Any]:
    """Top-1 agreement of bf16 with fp32 on the assistant tokens of ``n`` ShareGPT conversations."""
    same = in_top5 = total = used = 0
    for conv in load_conversations(n=n * 3, seed=0, min_turns=4):
        got = conversation_turns(tokenizer, conv, max_tokens)
        if got is None:
            continue
        ids, turns = got
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = models["float32"](x).logits[0].float()
            low = models["bfloat16"](x).logits[0].float()
        for t in turns:
            rows = slice(t.header - 1, t.end - 1)
            a, b = ref[rows].argmax(-1), low[rows]
            same += int((b.argmax(-1) == a).sum())
            in_top5 += int((b.topk(5, dim=-1).indices == a[:, None]).any(-1).sum())
            total += len(a)
        used += 1
        if used >= n:
            break
    return {"conversations": used, "reply_tokens": total, "top1_agreement": same / max(total, 1),
            "fp32_top1_in_bf16_top5": in_top5 / max(total, 1)}


def render(speed: dict[str, dict], agree: dict[str, Any], args: argparse.Namespace) -> str:
    """The Markdown report."""
    fp, bf = speed["float32"], speed["bfloat16"]
    lines = [
        f"bf16 vs fp32, default model, {torch.get_num_threads()} threads, "
        f"native bf16: {'yes' if cpu_has_fast_bf16() else 'no'}",
        "",
        "| | float32 | bfloat16 | bf16 / fp32 |",
        "|---|---:|---:|---:|",
        f"| fresh prefill of {fp['prompt_tokens']} tokens (time to first token) | {fp['ttft_s']:.3f} s | "
        f"{bf['ttft_s']:.3f} s | {bf['ttft_s'] / fp['ttft_s']:.2f}x time |",
        f"| decode ({args.decode_tokens} tokens) | {fp['decode_tok_s']:.1f} tok/s | {bf['decode_tok_s']:.1f} tok/s | "
        f"{bf['decode_tok_s'] / fp['decode_tok_s']:.2f}x speed |",
        "",
        f"Teacher-forced on {agree['reply_tokens']} reply tokens of {agree['conversations']} ShareGPT "
        f"conversations: bf16 top-1 equals fp32 top-1 on {100 * agree['top1_agreement']:.1f}% "
        f"(fp32's top-1 is in bf16's top-5 on {100 * agree['fp32_top1_in_bf16_top5']:.1f}%).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run both measurements and print the report (see the module doc)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dtype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-tokens", type=int, default=1000, help="history length for the speed test")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per timed turn")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (medians reported)")
    ap.add_argument("--n", type=int, default=10, help="conversations for the agreement test")
    ap.add_argument("--max-tokens", type=int, default=1024, help="cut agreement conversations to this many tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from chatkv import EngineConfig
    from chatkv.engine import Engine
    from chatkv.models import load_model

    loaded = {name: load_model(dtype=dt) for name, dt in DTYPES}
    # Both dtypes run the model as it is (no compiled decode step, compiling in the background).
    engines = {name: Engine(m, EngineConfig(kv_budget_bytes=512 << 20, compile=False)) for name, m in loaded.items()}
    history = _history(loaded["float32"].tokenizer, args.prefill_tokens)
    speed = time_turns(engines, history, args.decode_tokens, args.repeats)
    for e in engines.values():
        e.close()
    stock = {}
    for name, m in loaded.items():
        m.model.set_attn_implementation("sdpa")
        stock[name] = m.model
    agree = agreement(stock, loaded["float32"].tokenizer, args.n, args.max_tokens)
    print(render(speed, agree, args))
    write_json(args.out, {"speed": speed, "agreement": agree, "threads": torch.get_num_threads(),
                          "native_bf16": cpu_has_fast_bf16()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
