"""Continuous batching: aggregate decode throughput with N concurrent sessions,
and time to first token of a turn that arrives while others decode.

For each N (1, 4, 16, 64 by default) the same N one-turn conversations run
one after another, then all at once from N threads, each on a fresh engine,
``--repeats`` times alternating (the best of each is kept: the machine may be
shared). The table reports generated tokens per second (prefill included) of
each and their ratio (concurrent / sequential), the same ratio in tokens per
CPU-second of this process (which other processes' load does not skew), and
the largest batch the scheduler ran. Then 16
sessions decode long replies while a new session sends a message; its time to
first token is compared with the same turn on an idle engine.

Usage::

    python -m benchmarks.batching --model tiny:llama
    python -m benchmarks.batching --model default --sessions 1,4,16 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.models import LoadedModel, load_model


@dataclass
class ThroughputRow:
    """One N: tokens/s run one after another vs all at once."""

    sessions: int
    tokens: int
    sequential_tok_s: float
    concurrent_tok_s: float
    ratio: float
    cpu_ratio: float  # the same ratio in tokens per CPU-second of this process (robust to other load)
    max_batch_seqs: int
    preemptions: int


@dataclass
class TtftRow:
    """Time to first token of a new turn, idle engine vs while ``busy`` sessions decode."""

    busy_sessions: int
    idle_ttft_s: float
    busy_ttft_s: float
    busy_decode_tok_s: float


def _engine(loaded: LoadedModel, config: dict[str, Any]) -> Engine:
    return Engine(loaded, EngineConfig(**{"compile": False, **config}))  # batch sizes alike: none compiled


def _turn(engine: Engine, sid: str, text: str, new_tokens: int) -> int:
    chat = Chat(sid, engine=engine, persist=False, max_new_tokens=new_tokens, ignore_eos=True)
    try:
        chat.send(text)
        return len(chat.last_stats.token_ids) if chat.last_stats else 0
    finally:
        chat.close()


def _prompt(i: int) -> str:
    return f"Session {i}: tell me a story about the quick brown fox, part {i}."


def _sequential(loaded: LoadedModel, n: int, new_tokens: int, config: dict[str, Any]
                ) -> tuple[int, float, float]:
    """Tokens, wall seconds and CPU seconds of ``n`` turns one after another. The
    seconds are ``n`` times the median turn's: a shared machine's load spikes
    would otherwise weigh on long runs (large ``n``) more than on short ones."""
    engine = _engine(loaded, config)
    _turn(engine, "warmup", _prompt(-1), new_tokens)
    tokens, walls, cpus = 0, [], []
    for i in range(n):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens += _turn(engine, f"seq-{i}", _prompt(i), new_tokens)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return tokens, n * statistics.median(walls), n * statistics.median(cpus)


def _concurrent(loaded: LoadedModel, n: int, new_tokens: int, config: dict[str, Any]
                ) -> tuple[int, float, float, Engine]:
    engine = _engine(loaded, config)
    _turn(engine, "warmup", _prompt(-1), new_tokens)
    counts = [0] * n
    barrier = threading.Barrier(n + 1)

    def run(i: int) -> None:
        barrier.wait()
        counts[i] = _turn(engine, f"con-{i}", _prompt(i), new_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - start, time.process_time() - cpu, engine


def measure_throughput(loaded: LoadedModel, n: int, new_tokens: int, config: dict[str, Any],
                       repeats: int = 3) -> ThroughputRow:
    """Run ``n`` one-turn sessions one after another, then concurrently, ``repeats``
    times each (alternating, each on a fresh engine); the best tokens/s of each."""
    seq_rate = con_rate = seq_cpu = con_cpu = 0.0
    max_batch = preemptions = tokens = 0
    for _ in range(repeats):
        t, wall, cpu = _sequential(loaded, n, new_tokens, config)
        seq_rate, seq_cpu = max(seq_rate, t / wall), max(seq_cpu, t / cpu)
        tokens, wall, cpu, engine = _concurrent(loaded, n, new_tokens, config)
        con_rate, con_cpu = max(con_rate, tokens / wall), max(con_cpu, tokens / cpu)
        max_batch = max(max_batch, engine.scheduler.stats.max_batch_seqs)
        preemptions = max(preemptions, engine.scheduler.stats.preemptions)
    return ThroughputRow(n, tokens, seq_rate, con_rate, con_rate / seq_rate, con_cpu / seq_cpu, max_batch,
                         preemptions)


def measure_ttft(loaded: LoadedModel, busy: int, config: dict[str, Any], repeats: int = 3) -> TtftRow:
    """TTFT of a new turn on an idle engine, and while ``busy`` sessions decode long replies."""
    engine = _engine(loaded, config)
    _turn(engine, "warmup", "warm up", 4)
    idle = []
    for r in range(repeats):
        chat = Chat(f"idle-{r}", engine=engine, persist=False, max_new_tokens=2)
        chat.send(_prompt(1000 + r))
        idle.append(chat.last_stats.ttft_s or 0.0)
        chat.close()

    stop = threading.Event()
    first = threading.Barrier(busy + 1)
    produced = [0] * busy

    def decode(i: int) -> None:
        chat = Chat(f"busy-{i}", engine=engine, persist=False, max_new_tokens=100_000, ignore_eos=True)
        stream = chat.stream(_prompt(i))
        try:
            for k, _ in enumerate(stream):
                if k == 0:
                    first.wait()
                produced[i] += 1
                if stop.is_set():
                    break
        finally:
            stream.close()  # type: ignore[attr-defined]
            chat.close()

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(busy)]
    for t in threads:
        t.start()
    first.wait()
    time.sleep(0.2)
    busy_ttft = []
    t0, p0 = time.perf_counter(), sum(produced)
    for r in range(repeats):
        chat = Chat(f"new-{r}", engine=engine, persist=False, max_new_tokens=2)
        chat.send(_prompt(2000 + r))
        busy_ttft.append(chat.last_stats.ttft_s or 0.0)
        chat.close()
    rate = (sum(produced) - p0) / (time.perf_counter() - t0)  # pieces/s, about tokens/s
    stop.set()
    for t in threads:
        t.join()
    return TtftRow(busy, statistics.median(idle), statistics.median(busy_ttft), rate)


def render(model: str, rows: list[ThroughputRow], ttft: TtftRow | None, new_tokens: int) -> str:
    """The results as a Markdown table."""
    lines = [f"### {model}: {new_tokens} new tokens per turn", "",
             "| sessions | tokens | one after another tok/s | concurrent tok/s | ratio | ratio per CPU-s "
             "| max batch | preemptions |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.sessions} | {r.tokens} | {r.sequential_tok_s:.1f} | {r.concurrent_tok_s:.1f} | "
                     f"{r.ratio:.2f}x | {r.cpu_ratio:.2f}x | {r.max_batch_seqs} | {r.preemptions} |")
    if ttft is not None:
        lines += ["", f"TTFT of a new turn: idle engine {ttft.idle_ttft_s * 1000:.1f} ms; while "
                      f"{ttft.busy_sessions} sessions decode {ttft.busy_ttft_s * 1000:.1f} ms "
                      f"(they decoded ~{ttft.busy_decode_tok_s:.0f} tok/s meanwhile)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the measurements, print the table (and write JSON with --out)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny:llama", help="a model spec: tiny:llama, default, a path")
    ap.add_argument("--sessions", default="1,4,16,64", help="comma-separated session counts")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement (best is kept)")
    ap.add_argument("--busy", type=int, default=16, help="sessions decoding during the TTFT test (0: skip)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="pool size (default: by memory budget)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is steadier on a machine shared with other work)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    config: dict[str, Any] = {"block_size": args.block_size, "num_blocks": args.num_blocks, "device": args.device}
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    _concurrent(loaded, 4, args.new_tokens, config)  # first touches of the process: not measured
    rows = []
    for n in (int(x) for x in args.sessions.split(",") if x):
        rows.append(measure_throughput(loaded, n, args.new_tokens, config, args.repeats))
        print(f"  {n} sessions: ratio {rows[-1].ratio:.2f}x", flush=True)
    ttft = measure_ttft(loaded, args.busy, config, args.repeats) if args.busy else None
    print(render(args.model, rows, ttft, args.new_tokens))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "new_tokens": args.new_tokens, "throughput": [asdict(r) for r in rows],
                       "ttft": asdict(ttft) if ttft else None}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
