"""How fast ``chatkv sessions ls``, ``show`` and ``gc --dry-run`` answer on a store of many sessions.

Builds a throwaway ``CHATKV_HOME`` holding ``--sessions`` sessions (each a few
messages and one small KV chunk, written through :class:`chatkv.storage.Store`
with tiny tensors: no model is involved), then runs each command as a fresh
process (``python -m chatkv.cli.main ...``, as a user's shell would) and
reports the median wall time of ``--repeats`` runs, next to a bare
interpreter's start-up and the import of SQLAlchemy's ORM (the floor of any
command that opens the index) for scale. Each command also runs once under
``python -X importtime`` to see whether it imported torch or transformers:
these commands read only the index and must not.

The children may write bytecode caches (``PYTHONDONTWRITEBYTECODE`` is
dropped from their environment) and the ``-X importtime`` run comes first,
untimed: an installed package has its ``.pyc`` files, and compiling sources on
every start would measure the checkout rather than chatkv.

Exits 1 if any command imported torch or transformers, 2 if ``--strict`` and
a command's median exceeds ``--target-s``, else 0.

Usage::

    python -m benchmarks.cli_latency --sessions 200
    python -m benchmarks.cli_latency --sessions 1000 --repeats 5 --out /tmp/cli_latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HEAVY = ("torch", "transformers", "safetensors.torch")
FINGERPRINT = "bench-cli-latency"


@dataclass
class Timing:
    """One command's result: median and all wall times (seconds), and the heavy modules it imported."""

    command: str
    median_s: float
    runs_s: list[float]
    heavy_imports: list[str]


def build_home(home: Path, n_sessions: int, n_messages: int = 4, tokens: int = 32) -> None:
    """Write ``n_sessions`` sessions into a new store at ``home``: messages plus one tiny chunk each."""
    import torch

    from chatkv.storage import ChunkMeta, NewChunk, Store

    meta = ChunkMeta(fingerprint=FINGERPRINT, kv_format="bench-v1", dtype="float16", block_size=16)
    with Store(home) as store:
        for i in range(n_sessions):
            sid = f"bench-{i:05d}"
            store.open_session(sid, fingerprint=FINGERPRINT, system_prompt="be brief")
            store.append_messages(sid, [("user" if k % 2 == 0 else "assistant", f"message {k} of {sid}", None, False)
                                        for k in range(n_messages)])
            ids = [i * tokens + t for t in range(tokens)]  # distinct per session: no shared chunks
            kv = torch.full((2, 2, tokens // 16 or 1, 16, 1, 8), float(i % 7), dtype=torch.float16)
            store.save_kv(sid, token_ids=ids, fingerprint=FINGERPRINT, chunks=[NewChunk(tokens, {"kv": kv}, meta)])


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CHATKV_DB_URL", "PYTHONDONTWRITEBYTECODE")}
    env["CHATKV_HOME"] = str(home)
    return env


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - t0, res


def heavy_modules(importtime_log: str) -> list[str]:
    """The torch/transformers modules named in a ``python -X importtime`` log."""
    out = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if any(name == h or name.startswith(h + ".") for h in HEAVY):
                out.add(name)
    return sorted(out)


def time_command(label: str, args: list[str], env: dict[str, str], repeats: int) -> Timing:
    """Median wall time of ``python -m chatkv.cli.main ARGS`` over ``repeats`` fresh processes."""
    cli = [sys.executable, "-m", "chatkv.cli.main", *args]
    _, probe = _run([sys.executable, "-X", "importtime", *cli[1:]], env)
    if probe.returncode != 0:
        raise RuntimeError(f"`chatkv {' '.join(args)}` failed ({probe.returncode}): {probe.stderr[-2000:]}")
    runs = []
    for _ in range(repeats):
        dt, res = _run(cli, env)
        if res.returncode != 0:
            raise RuntimeError(f"`chatkv {' '.join(args)}` failed ({res.returncode}): {res.stderr[-2000:]}")
        runs.append(dt)
    return Timing(label, statistics.median(runs), runs, heavy_modules(probe.stderr))


def render(n_sessions: int, rows: list[Timing], target_s: float) -> str:
    """A plain-text table of the timings (reference rows, in parentheses, have no verdict)."""
    runs = [", ".join(f"{x:.3f}" for x in r.runs_s) for r in rows]
    w_cmd = max(len("command"), *(len(r.command) for r in rows))
    w_runs = max(len("runs"), *(len(x) for x in runs))
    goal = f"< {target_s:g} s"
    lines = [f"chatkv CLI latency, {n_sessions} sessions (fresh process each run, median)", "",
             f"{'command':<{w_cmd}}  {'median':>7}  {'runs':<{w_runs}}  torch?  {goal}"]
    for r, rs in zip(rows, runs):
        ref = r.command.startswith("(")
        torch_col = "" if ref else ("YES" if r.heavy_imports else "no")
        ok = "" if ref else ("yes" if r.median_s < target_s else "NO")
        lines.append(f"{r.command:<{w_cmd}}  {r.median_s:>6.3f}s  {rs:<{w_runs}}  {torch_col:<6}  {ok}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build the store, time the commands, print the table (and write JSON with --out); see the module doc."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cli_latency", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200, help="sessions in the store")
    ap.add_argument("--messages", type=int, default=4, help="messages per session")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each command (the median is reported)")
    ap.add_argument("--target-s", type=float, default=0.5, help="the latency goal per command")
    ap.add_argument("--strict", action="store_true", help="exit 2 if a command misses --target-s")
    ap.add_argument("--home", type=Path, default=None, help="build the store here (default: a temp dir, removed)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="chatkv-cli-latency-") as tmp:
        home = args.home or Path(tmp) / "home"
        t0 = time.perf_counter()
        build_home(home, args.sessions, args.messages)
        print(f"built {args.sessions} sessions in {time.perf_counter() - t0:.1f} s at {home}", flush=True)
        env = _env(home)
        rows = []
        # For scale: a bare interpreter, and the imports any command that opens the index needs.
        for label, code in (("(python -c pass)", "pass"), ("(import sqlalchemy.orm)", "import sqlalchemy.orm, click")):
            runs = [_run([sys.executable, "-c", code], env)[0] for _ in range(args.repeats)]
            rows.append(Timing(label, statistics.median(runs), runs, []))
        for label, cmd in (("sessions ls", ["sessions", "ls"]),
                           ("sessions show <id>", ["sessions", "show", "bench-00000"]),
                           ("sessions gc --dry-run", ["sessions", "gc", "--dry-run"])):
            rows.append(time_command(label, cmd, env, args.repeats))
    print(render(args.sessions, rows, args.target_s))
    if args.out:
        args.out.write_text(json.dumps({"sessions": args.sessions, "target_s": args.target_s,
                                        "results": [asdict(r) for r in rows]}, indent=2))
    measured = [r for r in rows if not r.command.startswith("(")]
    if any(r.heavy_imports for r in measured):
        for r in measured:
            if r.heavy_imports:
                print(f"{r.command} imported {', '.join(r.heavy_imports[:5])}", file=sys.stderr)
        return 1
    if args.strict and any(r.median_s >= args.target_s for r in measured):
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
