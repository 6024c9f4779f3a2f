"""Decode speed, chatkv against transformers (eager and SDPA) and llama.cpp, side by side.

    python -m benchmarks.decode --contexts 1000,2000,4000 --new-tokens 64 --repeats 5

Every (system, repeat) runs in a fresh process, the systems' order rotating
each repeat, so that no system inherits another's threads or caches: in one
process, each thread that has run torch operators keeps an OpenMP pool, and
two pools on two cores slow both (:mod:`chatkv.threads`). In each process the
system prefills a history of about ``context`` tokens (the same token ids for
transformers and llama.cpp; a chat message of that length for chatkv) and
then decodes ``--new-tokens`` greedy tokens; the figure is tokens per second
after the first token, the median over repeats. transformers runs the same
weights in the same dtype with a ``DynamicCache``; llama.cpp runs the GGUF
chatkv's default model was converted from (4-bit weights), with ``--threads``.
Prints a markdown table with chatkv's ratio to each peer, chatkv's time
to the first token of that decoding turn (a short message over the cached
history) and the decode goal's verdict, judged on chatkv's rate over
eager's in the same repeat (:func:`decode_goal`), and writes JSON with ``--out``.

``--busy N`` runs N busy-looping processes meanwhile, as a neighbour using
cores: compare ``--threads 1`` and ``--threads 2`` with
``CHATKV_ADAPT_THREADS=0`` (the thread count fixed) and without it (chatkv's
loop fits its thread count to the free cores, :class:`chatkv.threads.ThreadGovernor`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import write_json

SYSTEMS = ("chatkv", "transformers-eager", "transformers-sdpa", "llama.cpp")
#: Not in the default set: chatkv with ``cpu_attention="sdpa"`` (SDPA for every
#: row, where a bfloat16 model otherwise attends long contexts by products).
EXTRA_SYSTEMS = ("chatkv-sdpa",)
WORDS = ("a returning conversation reads its keys and values back from the pool instead of computing "
         "them again while the new turn decodes one token at a time ").split()


def _text(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


def _worker(system: str, contexts: list[int], new_tokens: int, threads: int, dtype: str) -> dict[str, Any]:
    """Run ``system`` in this process at every context length; ``{context: tokens/s}``."""
    import torch

    torch.set_num_threads(threads)
    from chatkv.hardware import resolve_dtype
    from chatkv.models import default_gguf_path, encode_chat, load_model

    dt = resolve_dtype(dtype)
    out: dict[str, Any] = {"system": system, "dtype": str(dt).replace("torch.", ""), "rates": {}, "contexts": {},
                           "ttft": {}}
    if system == "llama.cpp":
        from benchmarks.peers import LlamaCpp

        from transformers import AutoTokenizer

        loaded = None
        ctx = LlamaCpp(default_gguf_path(), "f16", max(contexts) + new_tokens + 64, threads)
    else:
        loaded = load_model("default", dtype=dt)
    if system.startswith("chatkv"):
        from chatkv import Chat, EngineConfig
        from chatkv.engine import Engine

        attention = "sdpa" if system == "chatkv-sdpa" else "auto"
        engine = Engine(loaded, EngineConfig(cpu_attention=attention))  # one loop thread, one OpenMP pool
        engine.wait_warm()
    elif system.startswith("transformers"):
        from benchmarks.peers import HFModel

        hf = HFModel(loaded.model)
        hf.model.set_attn_implementation(system.split("-")[1])
    for n in contexts:
        if system.startswith("chatkv"):
            chat = Chat(f"d{n}", engine=engine, persist=False, max_new_tokens=new_tokens, ignore_eos=True)
            words = n * 3 // 4
            chat.send(_text(words), max_new_tokens=2)  # the history: prefilled, cached
            chat.send("And then?")
            st = chat.last_stats
            rate = (len(st.token_ids) - 1) / st.decode_s
            out["ttft"][n] = st.ttft_s  # a returning turn: its short message over the cached history
            out["contexts"][n] = st.prompt_tokens
            chat.close()
        else:
            msgs = [{"role": "user", "content": _text(n * 3 // 4)}]
            tok = loaded.tokenizer if loaded is not None else AutoTokenizer.from_pretrained(
                str(_converted_dir()))
            ids = encode_chat(tok, msgs)
            out["contexts"][n] = len(ids)
            if system == "llama.cpp":
                ctx.llm.reset()
                _, decode_s, tokens = ctx.turn(ids, new_tokens)
            else:
                _, decode_s, tokens = hf.turn(ids, hf.new_cache(), new_tokens)
            rate = (len(tokens) - 1) / decode_s
        out["rates"][n] = rate
    return out


def _converted_dir() -> Path:
    from chatkv.models import _cached_conversion, default_gguf_path

    return _cached_conversion(default_gguf_path())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1000,2000,4000", help="history lengths in tokens, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32 or bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    p.add_argument("--busy", type=int, default=0,
                   help="run this many busy-looping processes meanwhile (a neighbour using a core)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every system ``--repeats`` times in fresh processes and print the table."""
    args = parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.worker:
        print(json.dumps(_worker(args.worker, contexts, args.new_tokens, args.threads, args.dtype)))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    started = time.perf_counter()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        _run_all(args, systems, runs)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    _report(args, contexts, runs, started)
    return 0


def _run_all(args: argparse.Namespace, systems: list[str], runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every repeat, every system in a fresh process, the order rotating."""
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for system in order:
            cmd = [sys.executable, "-m", "benchmarks.decode", "--worker", system, "--contexts", args.contexts,
                   "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--dtype", args.dtype]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
            if proc.returncode != 0:
                print(f"[decode] {system} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            runs[system].append({**json.loads(proc.stdout.strip().splitlines()[-1]), "repeat": rep})
            last = runs[system][-1]["rates"]
            print(f"[decode] repeat {rep + 1} {system}: " + ", ".join(f"{k}: {v:.1f} tok/s" for k, v in last.items()),
                  file=sys.stderr, flush=True)


#: The decode goal: chatkv at least this many times transformers' eager decode.
DECODE_GOAL = 1.5


def _rate(run: dict[str, Any], n: int) -> float | None:
    rates = run["rates"]
    return rates.get(str(n), rates.get(n))


def decode_goal(chatkv: list[dict[str, Any]], eager: list[dict[str, Any]], contexts: list[int]) -> list[str]:
    """The decode goal's lines: per context, chatkv's rate over transformers'
    eager rate in the same repeat (the two ran minutes apart at most, where
    the medians of all repeats compare runs up to the whole benchmark apart),
    the median of those ratios with the sign test's interval
    (:func:`benchmarks.report.median_interval`), and the verdict: met where
    the whole interval is at least :data:`DECODE_GOAL`, not met where it is
    all below, undecided otherwise."""
    from benchmarks.report import SAID, combined, interval_cell, median_interval, verdict

    by_repeat = {r.get("repeat", i): r for i, r in enumerate(eager)}
    cells, verdicts = [], []
    for n in contexts:
        ratios = [a / b for run in chatkv if (other := by_repeat.get(run.get("repeat"))) is not None
                  and (a := _rate(run, n)) and (b := _rate(other, n))]
        interval = median_interval(ratios)
        if interval is None:
            cells.append(f"{n} tok: not measured")
            continue
        verdicts.append(verdict(interval, DECODE_GOAL, at_least=True))
        cells.append(f"{n} tok: {interval_cell(interval, DECODE_GOAL, at_least=True)}")
    overall = SAID[combined(verdicts)] if verdicts else "undecided"
    return [f"Goal: decode at least {DECODE_GOAL}x transformers' eager decode in the same dtype, judged on "
            f"ratios paired by repeat (median, interval, coverage): {overall}.", "", "; ".join(cells) + "."]


def _report(args: argparse.Namespace, contexts: list[int], runs: dict[str, list[dict[str, Any]]],
            started: float) -> None:
    """Print the table (and write the JSON)."""
    med = {s: {n: statistics.median(r["rates"][str(n)] if str(n) in r["rates"] else r["rates"][n] for r in rs)
               for n in contexts} for s, rs in runs.items() if rs}
    dtype = next((rs[0]["dtype"] for rs in runs.values() if rs), args.dtype)
    busy = f", {args.busy} busy neighbour process(es)" if args.busy else ""
    lines = [f"Decode tokens/s (median of {args.repeats}, {args.new_tokens} new tokens, {args.threads} threads{busy}, "
             f"{dtype}; llama.cpp: 4-bit weights, f16 KV); chatkv's ratio in parentheses:", "",
             "| system | " + " | ".join(f"{n} tok" for n in contexts) + " |",
             "| --- |" + " ---: |" * len(contexts)]
    for s in med:
        cells = []
        for n in contexts:
            v = med[s][n]
            ratio = f" ({med['chatkv'][n] / v:.2f}x)" if "chatkv" in med and s != "chatkv" else ""
            cells.append(f"{v:.1f}{ratio}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for s in (s for s in runs if s.startswith("chatkv") and runs[s] and runs[s][0].get("ttft")):
        ttft = [statistics.median(r["ttft"][str(n)] if str(n) in r["ttft"] else r["ttft"][n] for r in runs[s])
                for n in contexts]
        lines += ["", f"{s}'s time to first token of that returning turn (its short message over the cached "
                      "history): " + ", ".join(f"{t * 1e3:.1f} ms at {n} tok" for n, t in zip(contexts, ttft)) + "."]
    if "chatkv" in med and "transformers-eager" in med:
        lines += ["", *decode_goal(runs["chatkv"], runs["transformers-eager"], contexts)]
    report = "\n".join(lines)
    print(report)
    print(f"[decode] {time.perf_counter() - started:.0f} s", file=sys.stderr)
    write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                          "median": med, "report": report})


if __name__ == "__main__":
    sys.exit(main())
