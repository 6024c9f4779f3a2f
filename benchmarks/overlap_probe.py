"""Would overlapping a restore's reads with the new turn's prefill pay on this machine?

A returning session's first turn first reads its KV chunk files into memory
(with their checksums), then prefills the new message over that KV. Started
at once, the two could take the longer of the two instead of their sum, if the
machine has room for both: cores the prefill leaves idle, and memory bandwidth.

This probe measures exactly that, with chatkv's own pieces: a ShareGPT history
of about ``--tokens`` tokens is saved as a session (exact KV chunk files), then,
repeated and interleaved, it times

- ``read``: every chunk file read through the restore's path
  (:meth:`~chatkv.storage.store.ChunkSource.read_into`, checksum included) on
  the restore's reader threads, into memory of its own;
- ``prefill``: the next user message's tokens prefilled over the history's
  KV on the engine's loop (the session's turn, without sampling);
- ``sequential``: ``read``, then ``prefill``;
- ``overlapped``: both started together.

It prints the medians and two ratios: ``overlapped / sequential`` (below 1:
overlapping saves time here) and ``max(read, prefill) / sequential`` (the most
it could save). Nothing is written into the session or the pool's prefix
cache.

Usage::

    python -m benchmarks.overlap_probe
    python -m benchmarks.overlap_probe --tokens 2000 --repeats 9 --out benchmarks/out/overlap.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.disk_formats import _history
from benchmarks.measure import write_json

USER = "Thanks. Could you sum that up in two sentences, please?"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the four timings (see the module doc); returns them with the ratios."""
    from chatkv import Chat, EngineConfig
    from chatkv.engine import Engine
    from chatkv.hardware import resolve_dtype
    from chatkv.models import load_model
    from chatkv.persistence import KV_TENSOR, RESTORE_READERS
    from chatkv.runner import StepInput
    from chatkv.sequence import Sequence
    from chatkv.storage import Store

    loaded = load_model(None if args.model == "default" else args.model, dtype=resolve_dtype(args.dtype))
    engine = Engine(loaded, EngineConfig(compile=False))
    engine.wait_warm()
    history = _history(loaded.tokenizer, args.tokens)
    context = engine.encode_chat(history, add_generation_prompt=False)
    turn = engine.encode_chat([*history, {"role": "user", "content": USER}], add_generation_prompt=True)
    assert turn[: len(context)] == context, "the chat template does not extend the history's tokens"
    readers = ThreadPoolExecutor(RESTORE_READERS, thread_name_prefix="probe-read")
    driver = ThreadPoolExecutor(1, thread_name_prefix="probe-restore")  # opens the files, as a restore's thread does
    times: dict[str, list[float]] = {"read": [], "prefill": [], "sequential": [], "overlapped": []}
    with tempfile.TemporaryDirectory(prefix="chatkv-overlap-") as home:
        store = Store(home)
        chat = Chat("probe", engine=engine, store=store, max_new_tokens=1)
        chat.append(history)
        chat.close()
        fingerprint = loaded.fingerprint
        infos = store.open_kv("probe", fingerprint=fingerprint)
        scratch: list[bytearray] = []
        for source in infos:
            dtype, shape = source.shapes[KV_TENSOR]
            scratch.append(bytearray(torch.Size(shape).numel() * dtype.itemsize))  # touched: no page faults timed
            source.close()
        disk_bytes = sum(c.bytes for c in infos.chunks)

        def read() -> None:
            stored = store.open_kv("probe", fingerprint=fingerprint)
            done = [readers.submit(source.read_into, {KV_TENSOR: [memoryview(buf)]})
                    for source, buf in zip(stored, scratch)]
            wait_all(done)
            for f in done:
                f.result()

        seq = Sequence(token_ids=list(context))

        def fill_context() -> None:
            while seq.num_computed < len(context):
                n = min(engine.config.max_prefill_tokens, len(context) - seq.num_computed)
                engine.runner.forward([StepInput(seq, seq.token_ids[seq.num_computed: seq.num_computed + n])])

        def prefill_job() -> None:
            seq.token_ids = list(turn)
            try:
                engine.runner.forward([StepInput(seq, turn[len(context):])])
            finally:
                engine.pool.truncate(seq, len(context))

        engine.call(fill_context)

        def prefill() -> None:
            engine.call(prefill_job)

        def sequential() -> None:
            read()
            prefill()

        def overlapped() -> None:
            reading = driver.submit(read)
            prefill()
            reading.result()

        runs: dict[str, Callable[[], None]] = {"read": read, "prefill": prefill, "sequential": sequential,
                                               "overlapped": overlapped}
        for fn in runs.values():  # once untimed: first-call costs
            fn()
        for _ in range(args.repeats):
            for name, fn in runs.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        engine.call(lambda: engine.pool.discard(seq))
        store.close()
    engine.close()
    readers.shutdown()
    driver.shutdown()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "context_tokens": len(context), "new_tokens": len(turn) - len(context), "disk_bytes": disk_bytes,
        "repeats": args.repeats, "times_s": times, "median_s": med,
        "overlapped_over_sequential": med["overlapped"] / med["sequential"],
        "best_over_sequential": max(med["read"], med["prefill"]) / med["sequential"],
    }


def render(r: dict[str, Any]) -> str:
    """The Markdown table."""
    med = r["median_s"]
    lines = [
        f"Restore reads against the turn's prefill: {r['model']} ({r['dtype']}), {r['threads']} threads, "
        f"{r['context_tokens']} history tokens ({r['disk_bytes'] / 1e6:.1f} MB of chunks), "
        f"{r['new_tokens']} new tokens, medians of {r['repeats']}",
        "",
        "| read | prefill | sequential | overlapped | overlapped / sequential | best possible |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {1e3 * med['read']:.1f} ms | {1e3 * med['prefill']:.1f} ms | {1e3 * med['sequential']:.1f} ms | "
        f"{1e3 * med['overlapped']:.1f} ms | {r['overlapped_over_sequential']:.2f} | {r['best_over_sequential']:.2f} |",
        "",
        "best possible: max(read, prefill) / sequential, what a perfect overlap would reach.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run and print the table (see the module doc)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.overlap_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="model to load (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU has it), float32 or bfloat16")
    ap.add_argument("--tokens", type=int, default=2000, help="history length")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs of each measurement, interleaved")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    results = run(args)
    print(render(results))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
