"""chatkv against its peers on real ShareGPT conversations: one command, one report.

    python -m benchmarks.run --sample 6 --per-bin 2 --out benchmarks/out/   # SmolLM2, < 30 min on 2 cores
    python -m benchmarks.run --smoke --out /tmp/bench-smoke/         # tiny model, < 1 min

Conversations are replayed teacher-forced (see :mod:`benchmarks.workload` and
:mod:`benchmarks.replay`); at each point every system answers the next turn
(time to first token, then ``--new-tokens`` greedy tokens), ``--repeats`` times,
the systems' order rotating every repeat so that noise from the shared machine
falls on all of them alike. Writes ``report.md``, ``results.json`` and PNG plots
to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import measure
from benchmarks.measure import (
    Sample,
    Unavailable,
    can_drop_caches,
    cpu_name,
    memory_bandwidth,
)
from benchmarks.peers import llama_cpp_systems, transformers_systems
from benchmarks.replay import ChatkvReplay, chatkv_systems
from benchmarks.throughput import measure_throughput
from benchmarks.workload import DEFAULT_BINS, SMOKE_BINS, Point, select_points


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` switches every default to the tiny run."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", type=int, default=None, help="most conversations to replay (default 6; smoke 1)")
    p.add_argument("--per-bin", type=int, default=None, help="histories per length bin (default 2; smoke 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=None, help="timed turns per system and point (default 3; smoke 1)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="model spec (default: SmolLM2; smoke: tiny:llama)")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the default model's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    p.add_argument("--conversations", type=Path, default=None,
                   help="a JSON list of conversations ([{role, content}, ...]) to use instead of ShareGPT")
    p.add_argument("--smoke", action="store_true", help="tiny model, tiny bins, one conversation, one repeat")
    p.add_argument("--evict", choices=("fadvise", "drop_caches", "none"), default="fadvise",
                   help="how the cold disk tier drops chunk files from the page cache")
    p.add_argument("--restart-repeats", type=int, default=None,
                   help="process restarts per point (default: --repeats; 0: skip the tier)")
    p.add_argument("--dtype", default="auto",
                   help="the model's dtype for chatkv and transformers: auto (bfloat16 on a CPU with native bf16), "
                        "float32 or bfloat16")
    p.add_argument("--idle-s", type=float, default=None,
                   help="seconds every system idles before each timed turn, as after a user's think time "
                        "(default 1; smoke 0; 0: back to back)")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--systems", default=None, help="comma-separated substrings: run only matching systems")
    p.add_argument("--bins", default=None,
                   help=f"comma-separated length bins to measure (default all: {','.join(DEFAULT_BINS)})")
    p.add_argument("--budget-min", type=float, default=26.0,
                   help="start no new point after this many minutes (keeps the default run under 30)")
    args = p.parse_args(argv)
    if args.bins:
        known = SMOKE_BINS if args.smoke else DEFAULT_BINS
        args.bins = [b for b in (x.strip() for x in args.bins.split(",")) if b]
        unknown = [b for b in args.bins if b not in known]
        if unknown:
            p.error(f"--bins: no bin {', '.join(unknown)} (there are {', '.join(known)})")
    if args.smoke:
        args.model = args.model or "tiny:llama"
        args.sample = args.sample or 1
        args.per_bin = args.per_bin or 1
        args.repeats = args.repeats or 1
        args.new_tokens = min(args.new_tokens, 8)
        args.no_llama = True
        args.idle_s = 0.0 if args.idle_s is None else args.idle_s
    args.idle_s = 1.0 if args.idle_s is None else args.idle_s
    args.sample = args.sample or 6
    args.per_bin = args.per_bin or 2
    args.repeats = args.repeats or 3
    if args.restart_repeats is None:
        args.restart_repeats = args.repeats
    return args


def _warm_llama_note() -> None:
    """llama.cpp logs to stderr from C; keep the terminal readable."""
    os.environ.setdefault("LLAMA_LOG_LEVEL", "error")


def geometry(model: Any) -> dict[str, Any]:
    """KV geometry and weight bytes of ``model``."""
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = list(model.parameters())
    return {
        "layers": cfg.num_hidden_layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "dtype": str(params[0].dtype).removeprefix("torch."), "dtype_bytes": params[0].element_size(),
        "weight_bytes": sum(t.numel() * t.element_size() for t in params),
        "max_context": int(getattr(cfg, "max_position_embeddings", 2048) or 2048),
    }


def _select(systems: list[Any], pattern: str | None) -> list[Any]:
    if not pattern:
        return systems
    keys = [k.strip().lower() for k in pattern.split(",") if k.strip()]
    return [s for s in systems if any(k in s.name.lower() for k in keys)]


def storage_report(bench: ChatkvReplay, geo: dict[str, Any]) -> dict[str, Any]:
    """Bytes of the replay on disk: written, logical, physical, per token, vs theory."""
    store = bench.store
    convs = [bench.session_id(c) for c in sorted({int(k[1:].split("-")[0]) for k in bench.snapshots})]
    sessions = convs + bench.snapshots
    tokens = {s: len(store.cached_token_ids(s)) for s in sessions}
    logical = sum(store.session_bytes(s).total for s in sessions)
    conv_bytes = sum(store.session_bytes(s).total for s in convs)
    usage = store.disk_usage()
    theory = 2 * geo["layers"] * geo["kv_heads"] * geo["head_dim"]
    return {
        "sessions": len(sessions), "conversation_sessions": len(convs),
        "tokens_logical": sum(tokens.values()), "tokens_conversations": sum(tokens[s] for s in convs),
        "bytes_logical": logical, "bytes_on_disk": usage.file_bytes, "files_on_disk": usage.n_files,
        "bytes_written": bench.bytes_written, "bytes_full_rewrite": bench.full_rewrite_bytes,
        "disk_bytes_per_token": conv_bytes / max(1, sum(tokens[s] for s in convs)),
        "device_bytes_per_token": bench.engine.pool.bytes_per_block / bench.engine.pool.block_size,
        "theory_bytes_per_token": {"fp32": theory * 4, "fp16/bf16": theory * 2, "8-bit": theory},
        "replay_prefill_s": bench.replay_prefill_s, "replayed_tokens": bench.replayed_tokens,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark; returns the results (also what ``results.json`` holds)."""
    from chatkv.hardware import resolve_dtype
    from chatkv.models import default_gguf_path, load_model

    started = time.perf_counter()
    measure.TURN_GAP_S = args.idle_s
    torch.set_num_threads(args.threads)
    _warm_llama_note()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.0f} s] {msg}", file=sys.stderr, flush=True)

    loaded = load_model(args.model, dtype=resolve_dtype(args.dtype))
    geo = geometry(loaded.model)
    bins = SMOKE_BINS if args.smoke else DEFAULT_BINS
    if args.bins:  # (parsed and checked with the arguments)
        bins = {b: bins[b] for b in args.bins}
    max_prompt = geo["max_context"] - args.new_tokens - 8
    source = json.loads(args.conversations.read_text()) if args.conversations else None
    convs, points = select_points(args.sample, args.per_bin, args.seed, loaded.tokenizer, bins, max_prompt, source=source)
    log(f"{loaded.name}: {len(convs)} conversations, {len(points)} points "
        f"({', '.join(f'{b}: {sum(p.bin == b for p in points)}' for b in bins)})")

    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bench = ChatkvReplay(loaded, work / "chatkv-home", args.model or "default", args.threads)
    systems: list[Any] = transformers_systems(loaded.model, args.new_tokens, work / "transformers")
    unavailable: list[Unavailable] = []
    if args.no_llama:
        unavailable.append(Unavailable("llama.cpp", "skipped (--no-llama or --smoke)"))
    else:
        gguf = args.gguf
        if gguf is None and args.model in (None, "default"):
            gguf = default_gguf_path()
        llama, missing = llama_cpp_systems(gguf, args.new_tokens, geo["max_context"], args.threads, work / "llama")
        systems += llama
        unavailable += missing
    systems += chatkv_systems(bench, args.new_tokens, args.evict, args.restart_repeats)
    systems = _select(systems, args.systems)
    bandwidth = memory_bandwidth()
    log(f"systems: {', '.join(s.name for s in systems)}; memory bandwidth {bandwidth / 1e9:.1f} GB/s")

    samples: list[Sample] = []
    failed: dict[str, str] = {}
    skipped: list[str] = []
    measured: list[Point] = []

    def attempt(system: Any, what: str, *call: Any) -> Any:
        if system.name in failed:
            return None
        try:
            return getattr(system, what)(*call)
        except Exception as exc:  # noqa: BLE001 -- one broken system must not sink the others' numbers
            failed[system.name] = f"{what} failed: {type(exc).__name__}: {exc}"
            log(f"{system.name}: {failed[system.name]}")
            return None

    for conv in range(len(convs)):
        for point in [p for p in points if p.conv == conv]:
            if time.perf_counter() - started > args.budget_min * 60:
                skipped.append(point.key)
                continue
            bench.advance(point)
            for s in systems:
                attempt(s, "prepare", point)
            rounds = range(-1 if not measured else 0, args.repeats)  # round -1 warms every system up
            for r in rounds:
                k = r + len(measured)
                for s in systems[k % len(systems):] + systems[: k % len(systems)]:
                    if r < 0 and s.name.endswith("restart"):
                        continue
                    sample = attempt(s, "measure", point, r)
                    if sample is not None and r >= 0:
                        samples.append(sample)
            for s in systems:
                attempt(s, "release", point)
            measured.append(point)
            got = [x for x in samples if x.point == point.key]
            log(f"{point.key}: {point.n_cached} + {point.n_delta} tokens; " + ", ".join(
                f"{name}={min(x.ttft_s for x in got if x.system == name):.3f}s"
                for name in dict.fromkeys(x.system for x in got)))
        bench.finish_conversation(conv)

    storage = storage_report(bench, geo)
    throughput = measure_throughput(bench.engine, measured, args.new_tokens)
    bench.close()
    unavailable += [Unavailable(n, r) for n, r in failed.items()]
    fidelity_path = args.out / "fidelity.json"
    fidelity = json.loads(fidelity_path.read_text()) if fidelity_path.is_file() else None
    return {
        "meta": {
            "model": loaded.name, "model_spec": args.model or "default", "fingerprint": loaded.fingerprint[:16],
            "threads": args.threads, "cpu": cpu_name(), "cpus": os.cpu_count(), "sample": args.sample, "per_bin": args.per_bin,
            "conversations": len(convs), "seed": args.seed, "repeats": args.repeats,
            "new_tokens": args.new_tokens, "bins": bins, "smoke": args.smoke, "evict": args.evict,
            "can_drop_caches": can_drop_caches(), "restart_repeats": args.restart_repeats, "idle_s": args.idle_s,
            "seconds": time.perf_counter() - started, "budget_min": args.budget_min,
            "command": " ".join(["python -m benchmarks.run", *getattr(args, "argv", [])]),
            "memory_bandwidth": bandwidth, "torch": torch.__version__,
        },
        "geometry": geo,
        "systems": [s.name for s in systems],
        "points": [{"key": p.key, "bin": p.bin, "n_cached": p.n_cached, "n_delta": p.n_delta} for p in measured],
        "skipped_points": skipped,
        "samples": [dataclasses.asdict(s) for s in samples],
        "unavailable": [dataclasses.asdict(u) for u in unavailable],
        "storage": storage,
        "throughput": throughput,
        "fidelity": fidelity,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write ``report.md``, ``results.json`` and the plots to ``--out``."""
    from benchmarks.report import write_report

    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    path = write_report(results, args.out)
    shutil.rmtree(args.out / "work", ignore_errors=True)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
