"""Restore or recompute, on both sides of the break-even point.

    python -m benchmarks.restore_choice --model tiny:llama --tokens 32,128,512,2048,6000
    python -m benchmarks.restore_choice --tokens 250,1000,4000
    python -m benchmarks.restore_choice --device cuda --model random:smollm2 --tokens 256,1024,4096,8000

A session of about each ``--tokens`` length is saved to disk. One engine
(``restore_policy="auto"``) learns its two rates as it runs: its warm-up and
every prefill step time the prefill, every restore the disk
(:mod:`chatkv.costs`); a first, untimed open of each session gives the disk
samples. Then each session is opened ``--repeats`` times in each of three
modes, the prefix cache emptied before each: the engine's own choice
(``auto``), forced to ``restore``, forced to ``recompute``; the same next turn
is sent each time and its time to first token measured from ``Chat()``. The
turn is rewound after each trial, so every trial resumes the same history.

The table gives, per length: the choice and the predictions behind it
(``RestoreInfo.decision`` / ``reason``), the measured time to first token of
each forced mode, and whether the choice was the faster one (times within
10% of each other count as level). On this project's CPU SmolLM2 always
restores: reading its KV beats prefilling it by an order of magnitude. On a
GPU short histories should recompute (:mod:`chatkv.costs`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.measure import write_json

#: Measured times within this fraction of each other count as level.
TIE = 0.1

WORDS = ("the", "river", "ran", "past", "a", "quiet", "town", "where", "people", "kept", "old", "maps")


def _history(engine: Any, target: int) -> list[dict[str, str]]:
    """One exchange whose templated tokens are about ``target``."""
    def messages(words: int) -> list[dict[str, str]]:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(words))
        return [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]

    words = max(1, target // 2)
    for _ in range(4):  # the ratio of tokens to words settles in a few steps
        n = len(engine.encode_chat(messages(words), add_generation_prompt=False))
        words = max(1, round(words * target / max(1, n)))
    return messages(words)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every length; returns the rows."""
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.decode_batch import load_benchmark_model
    from benchmarks.replay import timed_turn
    from chatkv import Chat, EngineConfig
    from chatkv.engine import Engine
    from chatkv.storage import Store

    loaded = load_benchmark_model(args.model, args.device)
    # A GPU's default pool is most of its memory: a few times the longest session is enough here.
    blocks = 8 * (max(args.tokens) + 256) // 16 + 256 if args.device == "cuda" else None
    engine = Engine(loaded, EngineConfig(restore_policy="auto", compile=False, num_blocks=blocks))
    engine.wait_warm()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chatkv-restore-choice-") as home:
        store = Store(home)
        sessions = {}
        for n in args.tokens:
            chat = Chat(f"s{n}", engine=engine, store=store, max_new_tokens=1)
            chat.append(_history(engine, n))
            sessions[n] = chat.num_cached_tokens
            chat.close()

        def trial(sid: str, mode: str) -> tuple[float, Any]:
            engine.costs.policy = mode
            engine.call(engine.pool.evict_cached, "cold prefix cache")
            ttft, _, _, chat, _ = timed_turn(lambda: Chat(sid, engine=engine, store=store), "And then?", 2)
            info = chat.restore
            chat.rewind(1)  # the next trial resumes the same history
            chat.close()
            return ttft, info

        for n in args.tokens:  # the disk's samples
            trial(f"s{n}", "restore")
        for n in args.tokens:
            times: dict[str, list[float]] = {"auto": [], "restore": [], "recompute": []}
            restore_s: list[float] = []  # the forced restores' own time (RestoreInfo.seconds)
            info = None
            for _ in range(args.repeats):
                for mode in times:
                    ttft, got = trial(f"s{n}", mode)
                    times[mode].append(ttft)
                    if mode == "auto":
                        info = got
                    elif mode == "restore":
                        restore_s.append(got.seconds)
            med = {m: statistics.median(t) for m, t in times.items()}
            ratio = med["recompute"] / med["restore"]
            # Within TIE of each other the two are level: either choice is right.
            faster = "either" if abs(ratio - 1) <= TIE else "restore" if ratio > 1 else "recompute"
            rows.append({"tokens": sessions[n], "decision": info.decision, "reason": info.reason,
                         "ttft_s": med, "faster": faster, "right": faster in ("either", info.decision),
                         "margin": ratio, "restore_s": statistics.median(restore_s)})
        store.close()
    fits = {"prefill": engine.costs.prefill.fit(), "disk": engine.costs.disk.fit()}
    engine.close()
    return {"model": loaded.name, "dtype": str(loaded.dtype), "threads": args.threads, "repeats": args.repeats,
            "device": args.device, "rows": rows, "fits": fits}


def render(result: dict[str, Any]) -> str:
    """The Markdown table."""
    lines = [f"Restore or recompute, {result['model']} ({result['dtype']}) on {result['device']}, "
             f"{result['threads']} threads, "
             f"medians of {result['repeats']}; time to first token from `Chat()`",
             "",
             "| history tokens | choice (auto) | auto | forced restore | forced recompute | recompute / restore "
             "| choice was the faster | reason |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in result["rows"]:
        t = r["ttft_s"]
        lines.append(f"| {r['tokens']} | {r['decision']} | {t['auto'] * 1e3:.1f} ms | {t['restore'] * 1e3:.1f} ms | "
                     f"{t['recompute'] * 1e3:.1f} ms | {r['margin']:.2f}x | "
                     f"{f'level (within {TIE:.0%})' if r['faster'] == 'either' else 'yes' if r['right'] else 'no'} | "
                     f"{r['reason']} |")
    lines.append("")
    lines.append("Forced restores' own time (`RestoreInfo.seconds`, medians): " + ", ".join(
        f"{r['tokens']}: {r['restore_s'] * 1e3:.1f} ms" for r in result["rows"] if "restore_s" in r) + ".")
    for name, unit, scale in (("prefill", "token", 1), ("disk", "MB", 1e6)):
        fit = result.get("fits", {}).get(name)
        if fit:
            lines.append(f"The engine's {name} fit: {fit[0] * 1e3:.1f} ms + {fit[1] * scale * 1e3:.3f} ms per {unit}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run and print the table (see the module doc)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.restore_choice", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default",
                    help="a model spec (default: SmolLM2), or random:smollm2 (its shape, random weights)")
    ap.add_argument("--tokens", default="250,1000,4000", help="history lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    result = run(args)
    print(render(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
