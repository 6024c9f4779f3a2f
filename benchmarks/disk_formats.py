"""Compact disk KV: bytes per token, restore time and fidelity of each ``disk_format``.

For each format (``exact``, ``bf16``, ``fp16``, ``int8``, ``fp8``, ``int4``) the
default model prefills the same ShareGPT history of about ``--tokens`` tokens
into a session saved in that format (``Chat.append``); then a fresh engine
opens it, and the restore (read, unpack, write into the pool) is timed from
``RestoreInfo``, ``--repeats`` times, formats interleaved so machine noise hits
all alike (every other round in reverse order). Reported per format: bytes
per token on disk (measured from the chunk files), median restore seconds,
restore bandwidth (bytes of pool KV made resident per second, against
plain reads of the same files from the page cache, medians of
``--repeats``: into reused 8 MB buffers, and into one buffer of their size
that, like the pool, is not in the CPU's cache; and each restore's
bandwidth over that of both reads made right after it, as pairs,
the median ratio with the sign test's interval), the same restore and read
with the files dropped from the page cache first (``POSIX_FADV_DONTNEED``:
read from the device, as after a long idle), each compact format's restore
time over exact's, as pairs likewise: from the page cache, over a restore
of exact's session made right before or right after it (by turns), from
the device over exact's in the same round; the same for a second restore of
exact's own session each round (``exact, again``, placed away from exact's
in the round: two identical restores, so its ratio is the run's own
spread, what a format's ratio must clear),
and the fidelity gate's measure (teacher-forced top-1 agreement and
mean KL over a reply, :func:`chatkv.fidelity.measure`). The gate's floors are
left aside (0) so every format is written; ``bf16`` and ``fp16`` of a bfloat16
model are written exact, as chatkv writes them (they would save no bytes), and
their restores are marked so, without a verdict.

Usage::

    python -m benchmarks.disk_formats
    python -m benchmarks.disk_formats --tokens 2000 --repeats 5 --out benchmarks/out/disk_formats.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import evict_page_cache, raw_read, raw_read_into, write_json
from benchmarks.report import interval_cell, median_interval
from benchmarks.sharegpt import load_conversations

FORMATS = ("exact", "bf16", "fp16", "int8", "fp8", "int4")
#: A second restore of exact's session each round: the run's own spread.
CONTROL = "exact, again"


def _history(tokenizer: Any, target: int) -> list[dict]:
    """A ShareGPT history of whole exchanges (ending with a reply) of at most ``target`` tokens:
    the first of at least 0.8x ``target``, else the longest found."""
    from chatkv.models import encode_chat

    best: list[dict] = []
    best_len = 0
    for conv in load_conversations(n=300, seed=2, min_turns=4):
        msgs: list[dict] = []
        length = 0
        for i in range(0, len(conv) - 1, 2):
            n = len(encode_chat(tokenizer, conv[: i + 2], False))
            if n > target:
                break
            msgs, length = conv[: i + 2], n
        if length > best_len:
            best, best_len = msgs, length
        if best_len >= 0.8 * target:
            break
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every format; returns the results by format."""
    from chatkv import Chat, EngineConfig, TierConfig
    from chatkv.engine import Engine
    from chatkv.fidelity import measure
    from chatkv.models import load_model
    from chatkv.storage import Store

    loaded = load_model(dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16)
    floors = {s: 0.0 for s in FORMATS if s != "exact"}

    def engine(fmt: str) -> Engine:
        tiers = TierConfig(disk_format=fmt, fidelity_floors=floors)
        # One engine per open (a pool that never held the session: every restore reads the
        # files), in the state a new process's engine is in when its first turn comes: its
        # warm-up done (which commits the pool's first pages: a restore into fresh pages
        # would time the kernel's page faults, not chatkv), nothing left on the loop; no
        # compile, which would compete with the restore for the cores.
        e = Engine(loaded, EngineConfig(kv_budget_bytes=budget, tiers=tiers, restore_policy="restore",
                                        compile=False))
        e.wait_warm()
        return e

    history = _history(loaded.tokenizer, args.tokens)
    budget = 4 * args.tokens * 46_080 * (1 if args.dtype == "float32" else 2) // 2 + (16 << 20)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="chatkv-disk-formats-") as home:
        store = Store(home)
        for fmt in FORMATS:
            e = engine(fmt)
            chat = Chat(f"s-{fmt}", engine=e, store=store, max_new_tokens=1)
            chat.append(history)
            chat.close()
            info = store.get_session(f"s-{fmt}")
            files = [Path(store.path_of(c)) for c in store.kv_chunks(f"s-{fmt}")]
            fid = measure(e, "none" if fmt == "exact" else fmt, [{"role": "system", "content": "Be helpful."},
                                                                  *history]) if fmt != "exact" else None
            results[fmt] = {"tokens": info.n_cached, "disk_bytes": sum(os.path.getsize(p) for p in files),
                            "files": [str(p) for p in files], "restore_s": [], "restore_cold_s": [],
                            "adjacent_exact_s": [], "pool_bytes": 0,
                            "written": e.call(e.tiers.effective_disk_scheme),
                            "top1_agreement": fid.top1_agreement if fid else 1.0,
                            "mean_kl": fid.mean_kl if fid else 0.0}
            e.close()
        results[CONTROL] = {**results["exact"], "restore_s": [], "restore_cold_s": [], "adjacent_exact_s": []}
        cold = "none"

        def restore(fmt: str, from_device: bool = False) -> float:
            """One restore of ``fmt``'s session into a fresh engine; its seconds."""
            nonlocal cold
            stored_as = "exact" if fmt == CONTROL else fmt
            e = engine(stored_as)
            if from_device:  # the files read from the device, as after a long idle
                cold = evict_page_cache(Path(p) for p in results[fmt]["files"])
            chat = Chat(f"s-{stored_as}", engine=e, store=store, max_new_tokens=1)
            r = chat.wait_restored()
            assert r.source == "disk" and r.cached_tokens == results[fmt]["tokens"], r
            results[fmt]["pool_bytes"] = r.cached_tokens * e.pool.bytes_per_block // e.pool.block_size
            chat.close()
            e.close()
            return r.seconds

        order = (*FORMATS, CONTROL)  # (the control last, so never beside exact's restore)
        for round_ in range(args.repeats):
            # Every other round in reverse, so that no format always follows the same one
            # (exact, first, followed int4's restore from the device in every round).
            for place, fmt in enumerate(order if round_ % 2 == 0 else order[::-1]):
                res = results[fmt]
                # From the page cache, every format but exact beside a restore of exact's
                # session, before it or after it by turns: the pair's ratio (a format's
                # against exact's a whole round away drifted by up to 9% for the same files).
                exact_first = fmt != "exact" and (round_ + place) % 2 == 0
                if exact_first:
                    res["adjacent_exact_s"].append(restore("exact"))
                res["restore_s"].append(restore(fmt))
                if fmt != CONTROL:  # the plain reads of the same files right after
                    files = [Path(p) for p in res["files"]]
                    for name, read in (("paired_read_s", raw_read), ("paired_read_into_s", raw_read_into)):
                        res.setdefault(name, []).append(read(files, repeats=1)[1])
                if fmt != "exact" and not exact_first:
                    res["adjacent_exact_s"].append(restore("exact"))
                res["restore_cold_s"].append(restore(fmt, from_device=True))
        # Every format's reads from the page cache before any from the device: formats
        # written exact share exact's files, and a cold read whole (one read a file)
        # brings them back as 4 kB pages, which read from the page cache at a third
        # of the speed of the large folios chatkv's own restores leave.
        measured = {fmt: res for fmt, res in results.items() if fmt != CONTROL}  # (the control's files are exact's)
        for fmt, res in measured.items():
            files = [Path(p) for p in res["files"]]
            n, t = raw_read(files, repeats=args.repeats)
            res["raw_read_bytes_per_s"] = n / t
            n, t = raw_read_into(files, repeats=args.repeats)
            res["raw_read_into_bytes_per_s"] = n / t
        for fmt, res in measured.items():
            files = [Path(p) for p in res["files"]]
            evict_page_cache(files)
            n, t = raw_read(files)
            res["raw_read_cold_bytes_per_s"] = n / t
            # Each restore's bandwidth over that of the plain read right after it: the VM's
            # memory speed drifts within a run, so a ratio of pairs, not of two medians.
            for name in ("paired_read_s", "paired_read_into_s"):
                res[name.replace("_s", "_ratio")] = median_interval(
                    (res["pool_bytes"] / restored) / (res["disk_bytes"] / read)
                    for restored, read in zip(res["restore_s"], res[name]))
        for res in results.values():
            del res["files"]
            res["cold"] = cold
            res["restore_median_s"] = statistics.median(res["restore_s"])
            res["restore_cold_median_s"] = statistics.median(res["restore_cold_s"])
            res["bytes_per_token"] = res["disk_bytes"] / res["tokens"]
            res["restore_bytes_per_s"] = res["pool_bytes"] / res["restore_median_s"]
        store.close()
    add_vs_exact(results)
    return results


def add_vs_exact(results: dict[str, dict[str, Any]]) -> None:
    """Give each format's results its restore time over exact's, as
    :func:`~benchmarks.report.median_interval` of pairs: from the page cache
    (``vs_exact_ratio``) over the restore of exact's session made right
    before or after it (``adjacent_exact_s``), from the device
    (``vs_exact_cold_ratio``) over exact's in the same round (each round
    restores every format in turn); ``vs_exact_round_ratio``, the page
    cache's over exact's in the same round, for the record. Pairs, not two
    medians: the VM's speed drifts between rounds more than formats differ.
    Results without adjacent restores (older runs) pair the page cache's by
    round too."""
    exact = results["exact"]
    for res in results.values():
        for key, name in (("restore_s", "vs_exact_round_ratio"), ("restore_cold_s", "vs_exact_cold_ratio")):
            res[name] = median_interval(mine / theirs for mine, theirs in zip(res[key], exact[key]))
        adjacent = res.get("adjacent_exact_s")
        res["vs_exact_ratio"] = (median_interval(mine / theirs for mine, theirs in zip(res["restore_s"], adjacent))
                                 if adjacent else res["vs_exact_round_ratio"])


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown tables: every format's numbers, exact's bandwidth against
    the plain reads, each format's restore over exact's with its verdict (and
    the control's, :data:`CONTROL`, without one: the run's own spread)."""
    exact = results["exact"]
    formats = {fmt: r for fmt, r in results.items() if fmt != CONTROL}
    lines = [
        f"Disk formats, default model ({args.dtype}), a {exact['tokens']}-token ShareGPT history, "
        f"{torch.get_num_threads()} threads, medians of {args.repeats}",
        "",
        "| format | bytes/token | vs exact | restore | restore bandwidth | plain read | plain read into memory "
        "| restore, cold | plain read, cold | top-1 agreement | mean KL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fmt, r in formats.items():
        lines.append(
            f"| {fmt} | {r['bytes_per_token']:,.0f} | {100 * r['bytes_per_token'] / exact['bytes_per_token']:.1f}% | "
            f"{1e3 * r['restore_median_s']:.1f} ms | {r['restore_bytes_per_s'] / 1e9:.2f} GB/s | "
            f"{r['raw_read_bytes_per_s'] / 1e9:.2f} GB/s | {r['raw_read_into_bytes_per_s'] / 1e9:.2f} GB/s | "
            f"{1e3 * r['restore_cold_median_s']:.1f} ms | "
            f"{r['raw_read_cold_bytes_per_s'] / 1e9:.2f} GB/s | {100 * r['top1_agreement']:.1f}% | "
            f"{r['mean_kl']:.4f} |")
    lines += ["", "Restore bandwidth over a plain read of the same files right after each restore "
              f"(medians of {args.repeats} pairs, the sign test's interval; the goal, for exact: at least 0.5x):",
              "",
              "| format | vs the plain read | vs the plain read into memory |", "|---|---:|---:|"]
    for fmt, r in formats.items():
        cells = []
        for name in ("paired_read_ratio", "paired_read_into_ratio"):
            # (the goal is exact KV's; a compact file holds fewer bytes)
            cells.append(interval_cell(r[name], 0.5, at_least=True) if fmt == "exact" else interval_cell(r[name]))
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    lines += ["", f"Restore time over exact's (medians of {args.repeats} pairs, the sign test's interval; from "
              "the page cache, over a restore of exact's session made right before or after it, by turns; from "
              "the device, over exact's in the same round; the goal: a compact format restores as fast as exact, "
              "at most 1.0x):", "",
              "| format | from the page cache | from the device |", "|---|---:|---:|"]
    for fmt, r in results.items():
        if fmt == "exact":
            continue
        if fmt == CONTROL:  # exact's own session restored again: no goal, the spread any ratio carries
            lines.append(f"| {fmt} (exact's own files: this run's spread) | {interval_cell(r['vs_exact_ratio'])} | "
                         f"{interval_cell(r['vs_exact_cold_ratio'])} |")
        elif r.get("written", fmt) == "none":  # exact chunks too: no goal to judge
            lines.append(f"| {fmt} (written exact) | {interval_cell(r['vs_exact_ratio'])} | "
                         f"{interval_cell(r['vs_exact_cold_ratio'])} |")
        else:
            lines.append(f"| {fmt} | {interval_cell(r['vs_exact_ratio'], 1.0)} | "
                         f"{interval_cell(r['vs_exact_cold_ratio'], 1.0)} |")
    lines.append("")
    lines.append("restore bandwidth: bytes of KV made resident in the pool per second; plain read: the chunk "
                 "files read whole from the page cache in 8 MB reads whose buffers are reused (so stay in the "
                 "CPU's cache); plain read into memory: the same, into one buffer the size of the files, its "
                 f"pages written before (as a warmed pool's); both medians of {args.repeats} reads; cold: the "
                 f"files dropped from the page cache first ({exact['cold']}), so read from the device.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run and print the table (see the module doc)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.disk_formats", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1000, help="history length")
    ap.add_argument("--repeats", type=int, default=3, help="timed restores per format")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's dtype")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    results = run(args)
    print(render(results, args))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
