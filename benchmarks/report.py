"""Turning the results of :mod:`benchmarks.run` into ``report.md`` and PNG plots.

Every figure is a median over all samples of a bin (each point of the bin times
each repeat), shown with its min and max; ratios are medians over medians,
except the restart goals' (:func:`restart_goals`), judged on ratios paired by
repeat with an interval around their median.
Speed-ups read "how many times faster than": ``baseline TTFT / system TTFT``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BASELINE = "transformers re-prefill"
HF_HOT = "transformers DynamicCache (hot)"
HF_RESUME = "transformers hand-made resume"
LLAMA_FILE = "llama.cpp state file (f16 KV)"
LLAMA_FILE_Q8 = "llama.cpp state file (q8_0 KV)"
HOT = "chatkv hot (device)"
DISK_WARM = "chatkv disk (page cache warm)"
DISK_COLD = "chatkv disk (page cache cold)"
RESTART = "chatkv after process restart"

Stats = tuple[float, float, float]  # min, median, max


def stats(values: Iterable[float]) -> Stats | None:
    """``(min, median, max)`` of ``values``, or None when empty."""
    v = [x for x in values if x is not None]
    return (min(v), statistics.median(v), max(v)) if v else None


#: The coverage asked of :func:`median_interval` for the goals' verdicts.
CONFIDENCE = 0.9
Interval = tuple[float, float, float, float]  # low, median, high, coverage


def median_interval(values: Iterable[float], confidence: float = CONFIDENCE) -> Interval | None:
    """``(low, median, high, coverage)``: the median of ``values`` and an
    interval that holds the true median with probability at least
    ``coverage`` whatever the distribution (the sign test's: order statistics
    ``k`` and ``n + 1 - k`` for the largest ``k`` with ``P(Binomial(n, 1/2) < k)
    <= (1 - confidence) / 2``). With too few values for ``confidence`` (fewer
    than 5 at 0.9) the interval is the whole range and ``coverage`` says what
    it holds. None when ``values`` is empty.
    """
    v = sorted(x for x in values if x is not None)
    n = len(v)
    if not n:
        return None

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) / 2 and below(k + 1) <= (1 - confidence) / 2:
        k += 1
    return v[k - 1], statistics.median(v), v[n - k], 1 - 2 * below(k)


def verdict(interval: Interval | None, limit: float, at_least: bool = False) -> bool | str | None:
    """A goal of "at most ``limit``" (with ``at_least``, "at least") against
    :func:`median_interval`'s result: True (met: the whole interval is on the
    goal's side of it), False (not met: the whole interval is beyond it),
    ``"undecided"`` (the interval holds the limit: these samples cannot
    tell), None (not measured)."""
    if interval is None:
        return None
    low, _, high, _ = interval
    if at_least:
        return True if low >= limit else (False if high < limit else "undecided")
    return True if high <= limit else (False if low > limit else "undecided")


#: What a table says for each :func:`verdict`.
SAID = {True: "met", False: "not met", "undecided": "undecided", None: "not measured"}


def interval_cell(interval: Interval, limit: float | None = None, at_least: bool = False) -> str:
    """``median x (low-high, coverage)`` of :func:`median_interval`'s
    ``interval`` of ratios, then its :func:`verdict` against ``limit`` where
    one is given: a table cell."""
    low, mid, high, coverage = interval
    said = "" if limit is None else " " + SAID[verdict(interval, limit, at_least=at_least)]
    return f"{mid:.2f}x ({low:.2f}-{high:.2f}, {coverage:.0%}){said}"


def combined(verdicts: list[bool | str | None]) -> bool | str | None:
    """One goal's verdict over several lengths (:func:`verdict` each): not
    measured if none was, not met if any is not, met if all are, otherwise
    undecided."""
    if not verdicts:
        return None
    return False if False in verdicts else True if all(v is True for v in verdicts) else "undecided"


class Results:
    """Indexed access to a results dict (see :func:`benchmarks.run.run`)."""

    def __init__(self, results: dict[str, Any]) -> None:
        """Index ``results["samples"]`` by system and bin."""
        self.raw = results
        self.meta = results["meta"]
        self.bins: list[str] = list(self.meta["bins"])
        self.systems: list[str] = [s for s in results["systems"]
                                   if any(x["system"] == s for x in results["samples"])]
        self.by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for s in results["samples"]:
            self.by[(s["system"], s["bin"])].append(s)
        self.bins = [b for b in self.bins if any(self.by.get((s, b)) for s in self.systems)]
        self.goal_bin = "2k" if "2k" in self.bins else (self.bins[-1] if self.bins else "")

    def values(self, system: str, bin: str, get: Callable[[dict[str, Any]], float | None]) -> list[float]:
        """``get`` of every sample of ``system`` in ``bin`` (Nones dropped)."""
        out = []
        for s in self.by.get((system, bin), []):
            v = get(s)
            if v is not None:
                out.append(v)
        return out

    def ttft(self, system: str, bin: str) -> Stats | None:
        """TTFT stats of ``system`` in ``bin``."""
        return stats(self.values(system, bin, lambda s: s["ttft_s"]))

    def decode(self, system: str, bin: str) -> Stats | None:
        """Decode tokens/s stats of ``system`` in ``bin``."""
        return stats(self.values(system, bin, lambda s: s["decode_tok_s"]))

    def speedup(self, faster: str, slower: str, bin: str) -> float | None:
        """``median TTFT(slower) / median TTFT(faster)`` in ``bin``."""
        a, b = self.ttft(faster, bin), self.ttft(slower, bin)
        return b[1] / a[1] if a and b and a[1] > 0 else None

    def history_tokens(self, bin: str) -> float | None:
        """Median history length of the bin's points."""
        v = [p["n_cached"] for p in self.raw["points"] if p["bin"] == bin]
        return statistics.median(v) if v else None


def _s(x: Stats | None, fmt: str = "{:.3f}", unit: str = "") -> str:
    if x is None:
        return "–"
    return f"{fmt.format(x[1])}{unit} ({fmt.format(x[0])}–{fmt.format(x[2])})"


def _x(r: float | None) -> str:
    if r is None:
        return "–"
    return f"{r:.2f}x" if r < 1 else (f"{r:.1f}x" if r < 100 else f"{r:.0f}x")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# --- sections --------------------------------------------------------------------------


def ttft_section(r: Results) -> list[str]:
    """TTFT by history length and the speed-ups over the baseline and each peer."""
    lines = ["## Time to first token of the next turn", "",
             ("Median seconds (min–max over points x repeats) and speed-up over the transformers "
             "re-prefill baseline. History: median tokens cached before the turn."), "",
             "| system | " + " | ".join(f"{b} ({r.history_tokens(b):.0f} tok)" for b in r.bins) + " |",
             "| --- |" + " ---: |" * len(r.bins)]
    for sys_ in r.systems:
        cells = []
        for b in r.bins:
            t = r.ttft(sys_, b)
            sp = r.speedup(sys_, BASELINE, b) if sys_ != BASELINE else None
            cells.append(_s(t) + ("" if sp is None else f" **{_x(sp)}**"))
        lines.append(f"| {sys_} | " + " | ".join(cells) + " |")
    peers = [s for s in r.systems if not s.startswith("chatkv")]
    tiers = [s for s in r.systems if s.startswith("chatkv")]
    if peers and tiers:
        lines += ["", (f"chatkv's speed-up over each peer (median TTFT ratio per bin, "
                      f"{' / '.join(r.bins)}; above 1 means chatkv is faster):"), "",
                  "| chatkv tier | " + " | ".join(peers) + " |", "| --- |" + " ---: |" * len(peers)]
        for t in tiers:
            lines.append(f"| {t} | " + " | ".join(
                " / ".join(_x(r.speedup(t, p, b)) for b in r.bins) for p in peers) + " |")
    restart = [s for b in r.bins for s in r.by.get((RESTART, b), [])]
    if restart:
        load = stats(s["extra"].get("model_load_s") for s in restart)
        whole = stats(s["extra"].get("process_to_first_token_s") for s in restart)
        lines += ["", (f"After a process restart, TTFT counts from `Chat()` in the new process; the process "
                      f"itself took {_s(whole, '{:.1f}', ' s')} from spawn to first token, of which model "
                      f"load {_s(load, '{:.1f}', ' s')} (the same for every system after a restart).")]
    return lines + [""]


def breakdown_section(r: Results) -> list[str]:
    """Where a resume's time to first token goes, at the goal bin."""
    b = r.goal_bin
    rows = []
    for sys_ in r.systems:
        samples = r.by.get((sys_, b), [])
        if not samples or not any("first_token_s" in s["extra"] for s in samples):
            continue

        def med(key: str, samples: list[dict[str, Any]] = samples) -> str:
            v = [s["extra"][key] for s in samples if key in s["extra"]]
            return f"{statistics.median(v) * 1e3:.0f}" if v else "–"

        rows.append(f"| {sys_} | {statistics.median(s['ttft_s'] for s in samples) * 1e3:.0f} | {med('open_s')} "
                    f"| {med('restore_s')} | {med('first_token_s')} |")
    if not rows:
        return []
    return ["### Where the time to first token goes", "",
            (f"Medians in ms at {b}. chatkv: `Chat()` returns once the session is opened (index, lease) and its "
            "restore runs in the background; restore = open + read + verify + copy into the pool (from "
            "`RestoreInfo.seconds`); first token = `Engine.generate`'s prefill of the delta and first sample. "
            "Peers: restore = loading the file and rebuilding the cache."), "",
            "| system | TTFT | Chat() | restore | first token |", "| --- | ---: | ---: | ---: | ---: |",
            *rows, ""]


def decode_section(r: Results) -> list[str]:
    """Decode tokens/s at 1k and 4k history (or every bin when those are absent)."""
    bins = [b for b in ("1k", "4k") if b in r.bins] or r.bins
    lines = ["## Decode speed", "", (f"Generated tokens per second after the first ({r.meta['new_tokens']} "
             "tokens per turn, greedy); median (min–max)."), "",
             "| system | " + " | ".join(bins) + " | vs transformers DynamicCache |",
             "| --- |" + " ---: |" * (len(bins) + 1)]
    for sys_ in r.systems:
        ratios = []
        for b in bins:
            a, h = r.decode(sys_, b), r.decode(HF_HOT, b)
            ratios.append(_x(a[1] / h[1]) if a and h else "–")
        lines.append(f"| {sys_} | " + " | ".join(_s(r.decode(sys_, b), "{:.1f}") for b in bins)
                     + " | " + " / ".join(ratios) + " |")
    bw, wb = r.meta["memory_bandwidth"], r.raw["geometry"]["weight_bytes"]
    lines += ["", (f"Weight-bandwidth limit: {_bytes(wb)} of weights read per token at "
                  f"{bw / 1e9:.1f} GB/s (measured: a sum over a 256 MiB tensor, {r.meta['threads']} threads) "
                  f"= {bw / wb:.1f} tokens/s."), ""]
    return lines


def bytes_section(r: Results) -> list[str]:
    """Bytes per cached token per tier and scheme vs theory; bytes on disk for the replay."""
    g, st = r.raw["geometry"], r.raw["storage"]
    elems = 2 * g["layers"] * g["kv_heads"] * g["head_dim"]
    lines = ["## Bytes per cached token", "",
             (f"Theory: 2 x {g['layers']} layers x {g['kv_heads']} KV heads x {g['head_dim']} head dim "
             f"= {elems:,} values per token."), "",
             "| where | bytes/token | theory | overhead |", "| --- | ---: | ---: | ---: |"]

    def row(name: str, measured: float | None, theory: float) -> None:
        if measured:
            lines.append(f"| {name} | {measured:,.0f} | {theory:,.0f} | {measured / theory - 1:+.1%} |")

    row(f"chatkv device pool ({g['dtype']})", st["device_bytes_per_token"], elems * g["dtype_bytes"])
    row(f"chatkv disk chunk files ({g['dtype']})", st["disk_bytes_per_token"], elems * g["dtype_bytes"])
    for name, theory in ((HF_RESUME, elems * g["dtype_bytes"]), (LLAMA_FILE, elems * 2),
                         (LLAMA_FILE_Q8, elems * 34 / 32)):
        per = [s["extra"]["state_bytes"] / s["history_tokens"] for b in r.bins for s in r.by.get((name, b), [])
               if s["extra"].get("state_bytes")]
        row(f"{name} file", statistics.median(per) if per else None, theory)
    lines += ["", ("q8_0 theory counts its per-32-value fp16 scale (34 bytes per 32 values); llama.cpp "
                  "state files also hold the last logits and the token ids, which weigh most on short histories."),
              "", "### Bytes on disk for the whole replay", "",
              (f"{st['conversation_sessions']} replayed sessions (saved after every teacher-forced turn) plus "
              f"{st['sessions'] - st['conversation_sessions']} snapshot sessions (one per point, sharing the "
              f"conversation's chunks, as a fork would):"), "",
              "| | bytes |", "| --- | ---: |",
              f"| logical (sum over sessions of their KV) | {_bytes(st['bytes_logical'])} |",
              (f"| on disk (content-addressed chunk files) | {_bytes(st['bytes_on_disk'])} "
              f"({st['files_on_disk']} files) |"),
              f"| written by the replay's incremental saves | {_bytes(st['bytes_written'])} |",
              f"| a full rewrite of the KV after every turn would write | {_bytes(st['bytes_full_rewrite'])} |",
              "", (f"Dedup: {st['bytes_logical'] / max(1, st['bytes_on_disk']):.2f}x logical/physical; "
                  f"incremental saves write {st['bytes_written'] / max(1, st['bytes_full_rewrite']):.0%} of "
                  "what whole-KV rewrites would. Conversations here share no prefix longer than a chunk "
                  "(only the template's default system prompt), so dedup comes from snapshots and turns."), ""]
    return lines


def bandwidth_section(r: Results) -> list[str]:
    """Restore bandwidth vs a raw read of the same files."""
    lines = ["## Restore bandwidth", "",
             ("Bytes of chunk files restored per second of restore (open, read, verify, copy into the "
             "pool) vs a plain `read()` of the same files in the same page-cache state."), "",
             "| tier | restore | raw read | restore / raw |", "| --- | ---: | ---: | ---: |"]
    for name in (DISK_WARM, DISK_COLD, RESTART):
        samples = [s for b in r.bins for s in r.by.get((name, b), []) if s["extra"].get("restore_s")]
        rest = stats(s["extra"]["bytes_read"] / s["extra"]["restore_s"] / 1e6 for s in samples
                     if s["extra"].get("bytes_read"))
        raw = stats(s["extra"]["raw_bytes"] / s["extra"]["raw_s"] / 1e6 for s in samples
                    if s["extra"].get("raw_s"))
        if rest:
            ratio = _x(rest[1] / raw[1]) if raw else "–"
            lines.append(f"| {name} | {_s(rest, '{:.0f}', ' MB/s')} | {_s(raw, '{:.0f}', ' MB/s')} | {ratio} |")
    ev = r.meta["evict"]
    lines += ["", (f"Cold: chunk files evicted with `{ev}` before each run "
                  f"(`/proc/sys/vm/drop_caches` is {'writable' if r.meta['can_drop_caches'] else 'not writable'} "
                  "here; `--evict drop_caches` uses it, which also evicts the model's weights machine-wide)."), ""]
    return lines


def fidelity_section(r: Results) -> list[str]:
    """Greedy agreement with the baseline, and the quantization fidelity report if present."""
    lines = ["## Fidelity", "", (f"Greedy tokens equal to the re-prefill baseline's on the same turn "
             f"(all {r.meta['new_tokens']} tokens):"), "", "| system | identical turns |", "| --- | ---: |"]
    ref = {s["point"]: s["tokens"] for s in r.raw["samples"] if s["system"] == BASELINE}
    for sys_ in r.systems:
        if sys_ == BASELINE:
            continue
        got = [s for s in r.raw["samples"] if s["system"] == sys_ and s["point"] in ref]
        same = sum(s["tokens"] == ref[s["point"]] for s in got)
        if got:
            lines.append(f"| {sys_} | {same}/{len(got)} |")
    lines += ["", "llama.cpp runs the GGUF's 4-bit weights, so its tokens differ by design.", ""]
    fid = r.raw.get("fidelity")
    if not fid:
        lines += [("Quantized tiers: no `fidelity.json` next to this report (run `python -m benchmarks.fidelity "
                  "--out <out>/fidelity.md` first to include it)."), ""]
        return lines
    lines += ["Quantized KV (from `fidelity.json`, `benchmarks/fidelity.py`):", "",
              "| scheme | bytes/token | top-1 agreement | mean KL | greedy exact |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, s in fid.get("schemes", {}).items():
        lines.append(f"| {name} | {s.get('bytes_per_token', 0):,.0f} | {s.get('top1_agreement', 0):.2%} | "
                     f"{s.get('kl_mean', 0):.2e} | {s.get('greedy_exact_rate', 0):.1%} |")
    return lines + [""]


def throughput_section(r: Results) -> list[str]:
    """N active sessions at once (continuous batching) vs the same run one after another."""
    tp = r.raw.get("throughput") or {}
    if not tp.get("available"):
        return ["## Throughput with N active sessions", "", f"Not measured: {tp.get('reason', 'no data')}.", ""]
    lines = ["## Throughput with N active sessions", "",
             "| sessions | tokens/s at once | tokens/s one after another | ratio | mean TTFT | largest batch |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in tp["rows"]:
        lines.append(f"| {row['sessions']} | {row['tokens_per_s']:.1f} | {row.get('sequential_tokens_per_s', 0):.1f} "
                     f"| {row.get('ratio', 0):.2f}x | {row['mean_ttft_s']:.3f} s | {row.get('max_batch', '-')} |")
    return lines + [""]


def goals(r: Results) -> list[tuple[str, bool | str | None, str]]:
    """The issue's goals as ``(goal, met, measured)``; ``met`` is None when not
    measurable, ``"undecided"`` where the samples cannot tell (:func:`verdict`)."""
    b = r.goal_bin
    out: list[tuple[str, bool | str | None, str]] = []

    def sp(a: str, c: str) -> float | None:
        return r.speedup(a, c, b)

    x = sp(DISK_WARM, BASELINE)
    out.append((f"disk resume at {b} >= 20x faster to first token than re-prefill", None if x is None else x >= 20,
                f"{_x(x)} (warm); cold {_x(sp(DISK_COLD, BASELINE))}"))
    for peer in (HF_RESUME, LLAMA_FILE):
        x = sp(DISK_WARM, peer)
        out.append((f"disk resume at {b} faster than {peer}", None if x is None else x > 1,
                    f"{_x(x)} (cold {_x(sp(DISK_COLD, peer))})"))
    x = sp(HOT, DISK_WARM)
    out.append((f"hot resume faster still than disk at {b}", None if x is None else x > 1, f"{_x(x)} over disk (warm)"))
    warm = [s for bb in r.bins for s in r.by.get((DISK_WARM, bb), [])
            if s["extra"].get("restore_s") and s["extra"].get("raw_s") and s["extra"].get("bytes_read")]
    if warm:
        ratio = statistics.median((s["extra"]["bytes_read"] / s["extra"]["restore_s"])
                                  / (s["extra"]["raw_bytes"] / s["extra"]["raw_s"]) for s in warm)
        out.append(("disk restore >= 0.5x raw read bandwidth of the same bytes", ratio >= 0.5, f"{ratio:.2f}x (warm)"))
    else:
        out.append(("disk restore >= 0.5x raw read bandwidth of the same bytes", None, "not measured"))
    bins = [bb for bb in ("1k", "4k") if bb in r.bins] or r.bins
    ratios = []
    for bb in bins:
        a, h = r.decode(HOT, bb), r.decode(HF_HOT, bb)
        if a and h:
            ratios.append((bb, a[1] / h[1]))
    out.append(("decode >= 1.2x transformers DynamicCache", all(v >= 1.2 for _, v in ratios) if ratios else None,
                ", ".join(f"{v:.2f}x at {bb}" for bb, v in ratios) or "not measured"))
    limit = r.meta["memory_bandwidth"] / r.raw["geometry"]["weight_bytes"]
    frac = [(bb, r.decode(HOT, bb)[1] / limit) for bb in bins if r.decode(HOT, bb)]
    out.append(("decode >= 70% of the weight-bandwidth limit", all(v >= 0.7 for _, v in frac) if frac else None,
                ", ".join(f"{v:.0%} at {bb}" for bb, v in frac) + f" of {limit:.1f} tok/s" if frac else "not measured"))
    return out + restart_goals(r)


def restart_goals(r: Results) -> list[tuple[str, bool | str | None, str]]:
    """The performance issue's goals for a session resumed from disk by a fresh
    process (model loaded, no turn yet), at every history length: time to first
    token at most 0.8x transformers' hand-made safetensors resume and at most
    its ``DynamicCache`` kept in RAM, and at most 1.1x the next turn of the same
    shape in the same process.

    Each is judged on ratios paired within a repeat (the restart's turn over the
    peer's turn of the same history in the same repeat, which ran minutes apart
    at most; the first turn over the next one of the same process), by the
    median of those ratios and the interval :func:`median_interval` gives it
    (:func:`verdict`): on a machine whose turns spread by a third, a goal is
    met or missed only where the whole interval says so."""
    out: list[tuple[str, bool | str | None, str]] = []

    def per_bin(goal: str, ratios: Callable[[str], list[float]], limit: float) -> None:
        got = [(b, iv) for b in r.bins if (iv := median_interval(ratios(b))) is not None]
        met = combined([verdict(iv, limit) for _, iv in got])
        cover = min(iv[3] for _, iv in got) if got else 0.0
        out.append((f"{goal} (median of paired ratios; interval covering {cover:.0%})", met,
                    ", ".join(f"{iv[1]:.2f}x ({iv[0]:.2f}–{iv[2]:.2f}) at {b}" for b, iv in got) or "not measured"))

    def against(system: str) -> Callable[[str], list[float]]:
        def ratios(b: str) -> list[float]:
            peer = {(s["point"], s["repeat"]): s["ttft_s"] for s in r.by.get((system, b), [])}
            return [s["ttft_s"] / peer[key] for s in r.by.get((RESTART, b), [])
                    if peer.get(key := (s["point"], s["repeat"]))]
        return ratios

    def first_over_next(b: str) -> list[float]:
        return [s["ttft_s"] / s["extra"]["next_ttft_s"] for s in r.by.get((RESTART, b), [])
                if s["extra"].get("next_ttft_s")]

    per_bin("after a process restart: TTFT <= 0.8x transformers' hand-made resume, every length",
            against(HF_RESUME), 0.8)
    per_bin("after a process restart: TTFT <= transformers' DynamicCache kept in RAM, every length",
            against(HF_HOT), 1.0)
    per_bin("first turn of a fresh process <= 1.1x the next turn of the same shape", first_over_next, 1.1)
    return out


def goals_section(r: Results, rows: list[tuple[str, bool | str | None, str]] | None = None) -> list[str]:
    """The goals table: of ``rows``, or of all of :func:`goals`."""
    lines = ["## Goals", "", "| goal | verdict | measured |", "| --- | --- | --- |"]
    for goal, met, measured in goals(r) if rows is None else rows:
        said = ("not measured" if met is None else "undecided: the interval holds the limit"
                if met == "undecided" else "met" if met else "**NOT met**")
        lines.append(f"| {goal} | {said} | {measured} |")
    return lines + [""]


def plots(r: Results, out: Path) -> list[str]:
    """Write the PNG plots; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for sys_ in r.systems:
        xs, ys, lo, hi = [], [], [], []
        for b in r.bins:
            t, h = r.ttft(sys_, b), r.history_tokens(b)
            if t and h:
                xs.append(h)
                ys.append(t[1])
                lo.append(t[1] - t[0])
                hi.append(t[2] - t[1])
        if xs:
            style = "-o" if sys_.startswith("chatkv") else "--s"
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=sys_)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("history (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"Next-turn TTFT, {r.meta['model']}, {r.meta['threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_history.png", dpi=120)
    plt.close(fig)
    files.append("ttft_vs_history.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / max(1, len(r.bins))
    for i, b in enumerate(r.bins):
        vals = [(r.decode(s, b) or (0, 0, 0))[1] for s in r.systems]
        ax.bar([j + i * width for j in range(len(r.systems))], vals, width, label=b)
    limit = r.meta["memory_bandwidth"] / r.raw["geometry"]["weight_bytes"]
    ax.axhline(limit, color="k", linestyle=":", label="weight-bandwidth limit (fp32)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(r.systems))])
    ax.set_xticklabels(r.systems, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "decode_tokens_per_s.png", dpi=120)
    plt.close(fig)
    files.append("decode_tokens_per_s.png")
    return files


def render(results: dict[str, Any], plot_files: list[str]) -> str:
    """The whole report as Markdown."""
    r = Results(results)
    m = r.meta
    lines = [
        "# chatkv vs peers on ShareGPT conversations", "",
        (f"`{m['command']}` — {m['model']} ({r.raw['geometry']['dtype']}), {m['conversations']} ShareGPT V3 "
        f"conversations (seed {m['seed']}) replayed teacher-forced, {len(r.raw['points'])} points, "
        f"{m['repeats']} interleaved repeats, {m['new_tokens']} generated tokens per turn, "
        f"{m['threads']} threads on {m['cpu']} ({m['cpus']} CPUs, shared: timings are noisy, medians "
        f"are what counts), torch {m['torch']}. Run took {m['seconds'] / 60:.1f} min."), "",
    ]
    if r.raw.get("skipped_points"):
        lines += [f"Skipped (time budget {m['budget_min']} min): {', '.join(r.raw['skipped_points'])}.", ""]
    lines += goals_section(r) + ttft_section(r) + breakdown_section(r)
    for f in plot_files:
        lines += [f"![{f}]({f})", ""]
    lines += decode_section(r) + bytes_section(r) + bandwidth_section(r) + fidelity_section(r) + throughput_section(r)
    if r.raw.get("unavailable"):
        lines += ["## Not measured", "", "| system | why |", "| --- | --- |"]
        lines += [f"| {u['name']} | {u['reason']} |" for u in r.raw["unavailable"]]
        lines.append("")
    lines += ["## Method", "",
              ("Each point is a real conversation cut before a user turn; the history (user turns and the "
              "*recorded* assistant replies) is the chat template of it, and every system caches exactly those "
              "token ids and prefills the same delta (the user turn and the assistant header). TTFT counts from "
              "the request (hot systems) or from the start of the resume (load of the file / `Chat()` of a "
              "stored session) to the first greedy token. Systems run in a rotating order within each repeat. "
              "chatkv replays each conversation turn by turn (prefill of each new exchange, incremental save); "
              "every timed chatkv turn runs on a clone of the point's snapshot in the store, so repeats start "
              "from the same state. The disk tiers open the session in an engine with an empty pool."), ""]
    return "\n".join(lines)


def write_report(results: dict[str, Any], out: Path) -> Path:
    """Write ``report.md`` and the plots into ``out``; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    files = plots(Results(results), out) if results["samples"] else []
    path = out / "report.md"
    path.write_text(render(results, files))
    return path
