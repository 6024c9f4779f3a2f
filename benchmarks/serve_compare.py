"""`chatkv serve` against `transformers serve` and llama.cpp's server, one command.

For each system in turn (never two at once) this starts its OpenAI-compatible
server on 127.0.0.1 on a free port, in a process group of its own and with a
private home or cache directory, waits until ``/v1/models`` answers (then
sends one short warm-up request), runs :mod:`benchmarks.loadgen` as a
subprocess with the same workload for every system (same seed, users,
duration, turns, reply length and think time, ``--history recorded`` so that
every server gets the same prompts whatever it replies), restarts the server
at the run's midpoint (SIGTERM, then SIGKILL after ``--stop-timeout``; started
again with the same arguments and the same home, so chatkv restores its
sessions from disk), collects loadgen's JSON and stops the server. It then
prints, per system, the later turns' (each conversation's turns after its
first) TTFT p50/p99, ITL p50, turns/s and cached fraction, before and after
the restart, chatkv's ratios against each peer, and the serving issue's goals
with a met/not met verdict. Everything lands in ``--out``: each system's
loadgen JSON and server log, ``summary.json`` and ``report.md``.

Usage::

    python -m benchmarks.serve_compare                          # all three, SmolLM2-135M-Instruct, 90 s each
    python -m benchmarks.serve_compare --systems chatkv,llama.cpp --duration 30
    python -m benchmarks.serve_compare --systems chatkv --model tiny:llama --users 2 --duration 6 --source synthetic

The servers:

* chatkv: ``python -m chatkv serve --model M --dtype D`` (``CHATKV_HOME`` a
  private temp dir; converted models come from the usual model cache);
* transformers: ``transformers serve --continuous-batching --device cpu
  --dtype D <chatkv's converted weights directory>`` (``HF_HOME`` private);
* llama.cpp: ``python -m llama_cpp.server --model <the GGUF file> --n_ctx
  8192 --n_threads T --n_threads_batch T --interrupt_requests False`` (its
  weights are the GGUF's own, 4-bit for the default model: it has no dtype
  option). It runs one request at a time; by default a new request would cut
  the one running short (an empty reply the client counts as a turn), so the
  others queue instead. ``--server-args 'llama.cpp=--cache True'`` adds its
  in-RAM prompt cache.

A system whose server cannot start (package missing, model it cannot load)
gets an ``unavailable: why`` line instead of a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatkv.testing_pg import free_port  # (standard library only: no torch, no database)

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("chatkv", "transformers", "llama.cpp")
ALIASES = {"chatkv": "chatkv", "transformers": "transformers", "transformers-serve": "transformers",
           "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama": "llama.cpp"}
TITLES = {"chatkv": "`chatkv serve`", "transformers": "`transformers serve --continuous-batching`",
          "llama.cpp": "llama.cpp's server (`llama_cpp.server`)"}
#: Environment variables of the caller that must not leak into a server (they would point it at the
#: caller's own store or keys).
SCRUBBED_ENV = ("CHATKV_HOME", "CHATKV_DB_URL", "CHATKV_API_KEY", "CHATKV_API_KEY_FILE", "CHATKV_DTYPE")


class Unavailable(Exception):
    """A system that cannot run here; the message says why."""


# --- processes --------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    return True


def start_process(state: dict[str, Any]) -> subprocess.Popen:
    """Start the server ``state`` describes, in a new session (its own process group), logging to
    ``state["log"]``; records its pid in ``state``."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env.update(state["env"])
    log = open(state["log"], "ab")  # noqa: SIM115 (the child keeps it)
    log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {shlex.join(state['argv'])}\n".encode())
    log.flush()
    try:
        proc = subprocess.Popen(state["argv"], env=env, cwd=state["cwd"], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    state["pid"] = proc.pid
    state["starts"] = state.get("starts", 0) + 1
    return proc


def stop_process(pid: int, timeout: float) -> dict[str, Any]:
    """SIGTERM the process group led by ``pid``, wait up to ``timeout`` seconds for the leader to
    exit, then SIGKILL the group. Returns how it went."""
    t0 = time.perf_counter()
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return {"signal": None, "seconds": 0.0}
    how = "SIGTERM"
    while alive(pid) and time.perf_counter() - t0 < timeout:
        time.sleep(0.1)
    if alive(pid):
        how = "SIGKILL"
        deadline = time.perf_counter() + 10
        while alive(pid) and time.perf_counter() < deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)
    try:  # anything the server left behind in its group
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return {"signal": how, "seconds": round(time.perf_counter() - t0, 3)}


def http_json(url: str, body: dict | None = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          "Authorization": "Bearer none"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def wait_ready(state: dict[str, Any], timeout: float) -> str | None:
    """Poll ``/v1/models`` until it answers; None when it did, else why not."""
    deadline = time.perf_counter() + timeout
    last = "no answer"
    while time.perf_counter() < deadline:
        if not alive(state["pid"]):
            return f"the server exited before answering ({last})"
        try:
            models = http_json(state["base_url"] + "/models", timeout=3)
            state["model_id"] = models["data"][0]["id"]
            return None
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError) as exc:
            last = f"{type(exc).__name__}: {exc}"[:200]
        time.sleep(0.25)
    return f"no answer on {state['base_url']}/models within {timeout:.0f} s ({last})"


def log_tail(path: str, lines: int = 6) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())[:600]


def restart_helper(state_path: Path) -> int:
    """``--restart-helper STATE``: the command loadgen runs at the midpoint. Stops the server the
    state file names, starts it again with the same arguments and environment (the same home),
    waits until it answers, and records the new pid and the timings in the state file."""
    state = json.loads(state_path.read_text())
    stopped = stop_process(state["pid"], state["stop_timeout"])
    t0 = time.perf_counter()
    start_process(state)
    err = wait_ready(state, state["start_timeout"])
    state.setdefault("restarts", []).append({**stopped, "ready_s": round(time.perf_counter() - t0, 3),
                                             "error": err})
    tmp = state_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, state_path)
    print(f"[serve_compare] {state['name']}: stopped ({stopped['signal']}, {stopped['seconds']} s), "
          f"{'back' if err is None else 'NOT back: ' + err} after {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0 if err is None else 1


# --- the systems ------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    dtype_note: str
    weights_note: str
    home: str
    state: dict[str, Any] = field(default_factory=dict)


def _python_out(code: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run ``code`` in a fresh Python (keeps torch out of this process) and return its last line."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise Unavailable((proc.stderr.strip().splitlines() or ["failed"])[-1][:300])
    return proc.stdout.strip().splitlines()[-1]


def _gguf_for(model: str) -> Path:
    if model.startswith("tiny:"):
        raise Unavailable(f"{model} is a random model built inside chatkv; no peer can load it")
    if model == "default":
        return Path(_python_out("from chatkv.models import default_gguf_path as p; print(p())"))
    if model.endswith(".gguf") and Path(model).is_file():
        return Path(model).resolve()
    raise Unavailable(f"llama.cpp needs a GGUF file; --model {model} is not one")


def _weights_dir_for(model: str) -> Path:
    """The transformers directory chatkv itself loads for ``model`` (converted from the GGUF once)."""
    if model.startswith("tiny:"):
        raise Unavailable(f"{model} is a random model built inside chatkv; no peer can load it")
    if Path(model).is_dir():
        return Path(model).resolve()
    gguf = _gguf_for(model)
    code = ("import sys; from pathlib import Path; from chatkv.models import _cached_conversion; "
            f"print(_cached_conversion(Path({str(gguf)!r})))")
    return Path(_python_out(code))


def build_server(name: str, args: argparse.Namespace, home: str, port: int, model_cache: str) -> Server:
    threads = str(args.threads)
    common = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    extra = shlex.split(args.server_args.get(name, ""))
    if name == "chatkv":
        argv = [sys.executable, "-m", "chatkv", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--model", args.model, *(["--dtype", args.dtype] if args.dtype else []), *extra]
        dtype = args.dtype or "auto"
        note = (f"--dtype {dtype}" + (" (bfloat16 on a CPU with native bf16, else float32)" if dtype == "auto"
                                      else "") + ", weights and KV")
        weights = "chatkv's converted safetensors" if not args.model.startswith("tiny:") else args.model
        env = {**common, "CHATKV_HOME": home, "CHATKV_MODEL_CACHE": model_cache}
        return Server(name, argv, env, note, f"{weights} ({args.model})", home)
    if name == "transformers":
        exe = shutil.which("transformers")
        if exe is None:
            raise Unavailable("the `transformers` command is not on PATH")
        for mod in ("fastapi", "uvicorn"):
            if __import__("importlib").util.find_spec(mod) is None:
                raise Unavailable(f"{mod} is not installed (pip install 'transformers[serving]')")
        weights = _weights_dir_for(args.model)
        argv = [exe, "serve", "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1",
                "--port", str(port), *(["--dtype", args.dtype] if args.dtype else []), *extra, str(weights)]
        dtype = args.dtype or "auto"
        note = f"--dtype {dtype}" + (" (from the weights' config)" if dtype == "auto" else "")
        env = {**common, "HF_HOME": home, "TRANSFORMERS_CACHE": os.path.join(home, "hub")}
        return Server(name, argv, env, note, f"chatkv's converted safetensors `{weights.name}`", home)
    if name == "llama.cpp":
        if __import__("importlib").util.find_spec("llama_cpp") is None:
            raise Unavailable("llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')")
        gguf = _gguf_for(args.model)
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", str(args.n_ctx), "--n_threads", threads,
                "--n_threads_batch", threads, "--interrupt_requests", "False", "--verbose", "False", *extra]
        note = "no dtype option (--dtype not passed): the GGUF's own weights, f16 KV"
        env = {**common, "HF_HOME": home}
        return Server(name, argv, env, note, f"GGUF `{gguf.name}`", home)
    raise ValueError(name)


# --- one run ----------------------------------------------------------------------------------


def loadgen_argv(args: argparse.Namespace, base_url: str, json_out: Path, restart_cmd: str | None) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.loadgen", "--base-url", base_url, "--users", str(args.users),
            "--duration", str(args.duration), "--max-turns", str(args.max_turns), "--max-tokens",
            str(args.max_tokens), "--think-time", str(args.think_time), "--seed", str(args.seed),
            "--temperature", "0", "--history", "recorded", "--source", args.source,
            "--conversations", str(args.conversations), "--max-chars", str(args.max_chars),
            "--request-timeout", str(args.request_timeout), "--json-out", str(json_out)]
    if restart_cmd is not None:
        argv += ["--restart-at", str(args.restart_at), "--restart-cmd", restart_cmd]
    return argv + ["--min-later-turns", str(args.min_later_turns)]


def scrape_metric(base_url: str, metric: str) -> float | None:
    """The sum of a Prometheus metric's samples on chatkv's /metrics (None if absent)."""
    try:
        req = urllib.request.Request(base_url.removesuffix("/v1") + "/metrics",
                                     headers={"Authorization": "Bearer none"})
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(metric) and not line.startswith("#") and
              line[len(metric):len(metric) + 1] in ("{", " ")]
    return sum(values) if values else None


def run_system(name: str, args: argparse.Namespace, out: Path, model_cache: str) -> dict[str, Any]:
    """Start, warm, load, restart and stop one system's server; its result entry."""
    home = tempfile.mkdtemp(prefix=f"serve_compare-{name.replace('.', '')}-")
    port = free_port()
    result: dict[str, Any] = {"system": name, "title": TITLES[name]}
    proc: subprocess.Popen | None = None
    state_path = out / f"{name}.state.json"
    try:
        try:
            server = build_server(name, args, home, port, model_cache)
        except Unavailable as exc:
            result["unavailable"] = str(exc)
            return result
        state = {"name": name, "argv": server.argv, "env": server.env, "cwd": str(REPO),
                 "log": str(out / f"{name}.log"), "base_url": f"http://127.0.0.1:{port}/v1",
                 "stop_timeout": args.stop_timeout, "start_timeout": args.start_timeout}
        Path(state["log"]).write_bytes(b"")
        result.update(command=shlex.join(server.argv), dtype=server.dtype_note, weights=server.weights_note,
                      base_url=state["base_url"])
        print(f"[serve_compare] {name}: starting {shlex.join(server.argv)}", file=sys.stderr)
        t0 = time.perf_counter()
        proc = start_process(state)
        threading.Thread(target=proc.wait, daemon=True).start()  # reaped as soon as it exits
        err = wait_ready(state, args.start_timeout)
        if err is not None:
            tail = log_tail(state["log"])
            result["unavailable"] = f"server did not start: {err}" + (f"; log: {tail}" if tail else "")
            return result
        result["start_s"] = round(time.perf_counter() - t0, 2)
        result["model_id"] = state["model_id"]
        if args.warmup:
            try:
                http_json(state["base_url"] + "/chat/completions",
                          {"model": state["model_id"], "messages": [{"role": "user", "content": "Hello!"}],
                           "max_tokens": 4, "temperature": 0}, timeout=args.request_timeout)
            except (OSError, ValueError) as exc:
                result["warmup_error"] = f"{type(exc).__name__}: {exc}"[:200]
        state_path.write_text(json.dumps(state, indent=1))
        restart_cmd = None
        if args.restart_at is not None:
            restart_cmd = shlex.join([sys.executable, "-m", "benchmarks.serve_compare", "--restart-helper",
                                      str(state_path)])
        json_out = out / f"{name}.json"
        json_out.unlink(missing_ok=True)
        lg = loadgen_argv(args, state["base_url"], json_out, restart_cmd)
        print(f"[serve_compare] {name}: up in {result['start_s']} s; loadgen for {args.duration:g} s"
              + (f", restart at {args.restart_at:g} s" if restart_cmd else ""), file=sys.stderr)
        waits = args.request_timeout if args.min_later_turns else 0.0  # as loadgen's start_limit
        limit = args.duration + waits + args.request_timeout + args.start_timeout + args.stop_timeout + 120
        try:
            done = subprocess.run(lg, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=limit,
                                  env={k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV})
            (out / f"{name}.loadgen.txt").write_text(done.stdout)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        state = json.loads(state_path.read_text())  # the restart helper's pid and timings
        result["restarts"] = state.get("restarts", [])
        if json_out.is_file():
            result["loadgen"] = json.loads(json_out.read_text())
        else:
            result["unavailable"] = f"loadgen wrote no report (exit {rc})"
        if name == "chatkv" and alive(state["pid"]):
            result["session_restores"] = scrape_metric(state["base_url"], "chatkv:session_restores_total")
        result["stop"] = stop_process(state["pid"], args.stop_timeout)
        return result
    finally:
        if proc is not None:
            try:
                state = json.loads(state_path.read_text()) if state_path.is_file() else {"pid": proc.pid}
            except ValueError:
                state = {"pid": proc.pid}
            for pid in {proc.pid, state.get("pid", proc.pid)}:
                if alive(pid):
                    stop_process(pid, args.stop_timeout)
        shutil.rmtree(home, ignore_errors=True)


# --- the report -------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} ms" if x >= 10 else f"{x:.1f} ms"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _rx(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def metrics(summary: dict[str, Any] | None) -> dict[str, Any]:
    if not summary:
        return {"turns": 0, "errors": 0, "ttft_p50": None, "ttft_p99": None, "itl_p50": None,
                "turns_per_s": None, "cached": None}
    return {"turns": summary["turns"], "errors": summary["errors"], "ttft_p50": summary["ttft_ms"]["p50"],
            "ttft_p99": summary["ttft_ms"]["p99"], "itl_p50": summary["itl_ms"]["p50"],
            "turns_per_s": summary["turns_per_s"], "cached": summary["cached_fraction"]}


def system_rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    lg = result.get("loadgen") or {}
    rows = {"all later turns": metrics(lg.get("later_turns"))}
    if "before_restart" in lg:
        rows["before restart"] = metrics(lg.get("before_restart"))
        rows["after restart"] = metrics(lg.get("after_restart"))
    return rows


def goals(results: dict[str, dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """The issue's goals, each with a verdict: met, not met, or not measured."""
    def later(name: str) -> dict[str, Any] | None:
        r = results.get(name)
        if r is None or "unavailable" in r or not r.get("loadgen"):
            return None
        m = metrics(r["loadgen"].get("later_turns"))
        return m if m["turns"] else None

    def why_missing(name: str) -> str:
        r = results.get(name)
        if r is None:
            return f"{name} not run (--systems)"
        return f"{name} {r.get('unavailable', 'gave no later turns')}"

    out = []
    ck, tf, ll = later("chatkv"), later("transformers"), later("llama.cpp")

    def add(goal: str, verdict: bool | None, detail: str) -> None:
        out.append({"goal": goal, "verdict": None if verdict is None else bool(verdict), "detail": detail})

    g1 = "later-turn TTFT p50 at most 1/3 of transformers serve's"
    g2 = "later-turn turns/s at least 3x transformers serve's"
    g3 = "ahead of llama.cpp's server on later-turn TTFT p50 and turns/s"
    if ck is None:
        for g in (g1, g2, g3):
            add(g, None, why_missing("chatkv"))
    else:
        if tf is None:
            add(g1, None, why_missing("transformers"))
            add(g2, None, why_missing("transformers"))
        else:
            r = _ratio(tf["ttft_p50"], ck["ttft_p50"])
            add(g1, r is not None and r >= 3, f"{_ms(ck['ttft_p50'])} vs {_ms(tf['ttft_p50'])} ({_rx(r)} faster)")
            r = _ratio(ck["turns_per_s"], tf["turns_per_s"])
            add(g2, r is not None and r >= 3,
                f"{_num(ck['turns_per_s'])} vs {_num(tf['turns_per_s'])} turns/s ({_rx(r)})")
        if ll is None:
            add(g3, None, why_missing("llama.cpp"))
        else:
            t_ok = None not in (ck["ttft_p50"], ll["ttft_p50"]) and ck["ttft_p50"] < ll["ttft_p50"]
            s_ok = None not in (ck["turns_per_s"], ll["turns_per_s"]) and ck["turns_per_s"] > ll["turns_per_s"]
            add(g3, t_ok and s_ok, f"TTFT p50 {_ms(ck['ttft_p50'])} vs {_ms(ll['ttft_p50'])} "
                                   f"({'ahead' if t_ok else 'behind'}), turns/s {_num(ck['turns_per_s'])} vs "
                                   f"{_num(ll['turns_per_s'])} ({'ahead' if s_ok else 'behind'})")
    g4 = (f"after the restart no worse than before (chatkv's later-turn TTFT p50, turns/s and cached "
          f"fraction, {100 * tolerance:.0f}% noise allowed)")
    rows = system_rows(results["chatkv"]) if "chatkv" in results and later("chatkv") else {}
    if "after restart" not in rows or not rows["after restart"]["turns"] or not rows["before restart"]["turns"]:
        add(g4, None, why_missing("chatkv") if ck is None else "no later turns on both sides of a restart")
    else:
        b, a = rows["before restart"], rows["after restart"]
        parts, ok = [], True
        if None not in (a["ttft_p50"], b["ttft_p50"]):
            good = a["ttft_p50"] <= b["ttft_p50"] * (1 + tolerance)
            ok &= good
            parts.append(f"TTFT p50 {_ms(a['ttft_p50'])} after vs {_ms(b['ttft_p50'])} before "
                         f"({'ok' if good else 'worse'})")
        if None not in (a["turns_per_s"], b["turns_per_s"]):
            good = a["turns_per_s"] >= b["turns_per_s"] * (1 - tolerance)
            ok &= good
            parts.append(f"turns/s {_num(a['turns_per_s'])} vs {_num(b['turns_per_s'])} "
                         f"({'ok' if good else 'worse'})")
        if None not in (a["cached"], b["cached"]):
            good = a["cached"] >= b["cached"] * (1 - tolerance)
            ok &= good
            parts.append(f"cached {_pct(a['cached'])} vs {_pct(b['cached'])} ({'ok' if good else 'worse'})")
        add(g4, ok, "; ".join(parts))
    return out


def render(summary: dict[str, Any]) -> str:
    a = summary["workload"]
    results = summary["results"]
    lines = ["# Serving: chatkv against transformers serve and llama.cpp's server", "",
             f"Workload (the same for every server): {a['users']} users, {a['duration']:g} s, "
             + (f"server restarted at {a['restart_at']:g} s (SIGTERM; same arguments and home), "
                if a["restart_at"] is not None else "no restart, ")
             + (f"load going on until {a['min_later_turns']} later turns had succeeded"
                + (" after it" if a["restart_at"] is not None else "") + ", "
                if a.get("min_later_turns") else "")
             + f"`--source {a['source']}` (up to {a['max_chars']} characters), `--history recorded`, "
               f"up to {a['max_turns']} user turns and {a['max_tokens']} greedy tokens a reply, "
               f"{a['think_time']:g} s mean think time, seed {a['seed']}; model `{a['model']}`; "
               f"{a['threads']} threads per server. Rows: turns after each conversation's first; "
               "TTFT and ITL (between streamed chunks) as the official `openai` client saw them; "
               "cached = `usage.prompt_tokens_details.cached_tokens` / `prompt_tokens` (- where the "
               "server reports none).", ""]
    for name, r in results.items():
        lines.append(f"## {name}: {r['title']}")
        lines.append("")
        if "unavailable" in r:
            lines += [f"unavailable: {r['unavailable']}", ""]
            continue
        lines.append(f"dtype: {r['dtype']}; weights: {r['weights']}; up in {r.get('start_s', '-')} s")
        lines.append("")
        lines.append(f"    {r['command']}")
        lines.append("")
        for rs in r.get("restarts", []):
            lines.append(f"restart: stopped by {rs['signal']} in {rs['seconds']:.1f} s, answering again "
                         f"{rs['ready_s']:.1f} s later" + (f" (failed: {rs['error']})" if rs.get("error") else ""))
        if r.get("session_restores") is not None:
            lines.append(f"sessions restored from disk after the restart: {r['session_restores']:.0f} "
                         "(chatkv:session_restores_total)")
        if r.get("warmup_error"):
            lines.append(f"warm-up request failed: {r['warmup_error']}")
        lines += ["", "| later turns | turns | errors | TTFT p50 | TTFT p99 | ITL p50 | turns/s | cached |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, m in system_rows(r).items():
            lines.append(f"| {label} | {m['turns']} | {m['errors']} | {_ms(m['ttft_p50'])} | {_ms(m['ttft_p99'])} "
                         f"| {_ms(m['itl_p50'])} | {_num(m['turns_per_s'], '{:.3f}')} | {_pct(m['cached'])} |")
        samples = (r.get("loadgen") or {}).get("error_samples")
        if samples:
            lines.append("")
            lines.append("errors: " + " | ".join(samples))
        lines.append("")
    ck = results.get("chatkv")
    peers = [n for n, r in results.items() if n != "chatkv" and "unavailable" not in r and r.get("loadgen")]
    if ck is not None and "unavailable" not in ck and ck.get("loadgen") and peers:
        lines += ["## chatkv against each peer", "",
                  "TTFT: the peer's p50 over chatkv's (above 1: chatkv answers sooner); turns/s: chatkv's "
                  "over the peer's (above 1: chatkv serves more).", "",
                  "| peer | rows | TTFT p50 | TTFT p99 | turns/s |", "| --- | --- | ---: | ---: | ---: |"]
        mine = system_rows(ck)
        for p in peers:
            theirs = system_rows(results[p])
            for label, m in mine.items():
                t = theirs.get(label)
                if t is None:
                    continue
                lines.append(f"| {p} | {label} | {_rx(_ratio(t['ttft_p50'], m['ttft_p50']))} | "
                             f"{_rx(_ratio(t['ttft_p99'], m['ttft_p99']))} | "
                             f"{_rx(_ratio(m['turns_per_s'], t['turns_per_s']))} |")
        lines.append("")
    lines += ["## Goals (chatkv serve, same workload and model)", ""]
    for g in summary["goals"]:
        v = {True: "met", False: "not met", None: "not measured"}[g["verdict"]]
        lines.append(f"- {g['goal']}: **{v}** ({g['detail']})")
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated, run in this order: chatkv, transformers, llama.cpp [all]")
    p.add_argument("--model", default="default",
                   help="default (SmolLM2-135M-Instruct), a .gguf file, a model directory (no llama.cpp), "
                        "or tiny:<arch> (chatkv only, for smoke runs)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="passed as --dtype to chatkv serve and transformers serve (llama.cpp has none) [float32]")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per server [2]")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load per system")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default="sharegpt", help="loadgen's --source: sharegpt, synthetic or a JSON file")
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=8000)
    p.add_argument("--restart-at", type=float, default=None, help="seconds in [the midpoint]")
    p.add_argument("--no-restart", action="store_true", help="no server restart")
    p.add_argument("--min-later-turns", type=int, default=0,
                   help="load past --duration until this many later turns (after the restart, with one) have "
                        "succeeded, at most --request-timeout seconds more (loadgen's option) [0]")
    p.add_argument("--restart-tolerance", type=float, default=0.10,
                   help="noise allowed by the 'after the restart no worse' goal [0.10]")
    p.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp's --n_ctx [8192]")
    p.add_argument("--server-args", action="append", default=[], metavar="SYSTEM=ARGS",
                   help="extra arguments for one system's server, e.g. 'llama.cpp=--cache True' (repeatable)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server gets to answer")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the one short request sent before the load (not after the restart)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "serve_compare")
    p.add_argument("--restart-helper", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restart_helper is not None:
        return args
    systems = []
    for s in args.systems.split(","):
        s = s.strip().lower()
        if not s:
            continue
        if s not in ALIASES:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
        if ALIASES[s] not in systems:
            systems.append(ALIASES[s])
    if not systems:
        p.error("--systems names none")
    args.systems = systems
    extra = {}
    for item in args.server_args:
        name, sep, rest = item.partition("=")
        if not sep or ALIASES.get(name.strip().lower()) is None:
            p.error(f"--server-args wants SYSTEM=ARGS, got {item!r}")
        extra[ALIASES[name.strip().lower()]] = rest
    args.server_args = extra
    if args.users < 1 or args.duration <= 0 or args.threads < 1:
        p.error("--users, --duration and --threads must be positive")
    if args.no_restart:
        args.restart_at = None
    elif args.restart_at is None:
        args.restart_at = args.duration / 2
    elif not 0 < args.restart_at < args.duration:
        p.error("--restart-at must fall inside the run")
    if args.min_later_turns < 0:
        p.error("--min-later-turns must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every system in turn and print the report; 0 if at least one produced turns."""
    args = parse_args(argv)
    if args.restart_helper is not None:
        return restart_helper(args.restart_helper)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from chatkv.config import model_cache_dir  # no torch: the shared cache of converted models

    model_cache = str(model_cache_dir())
    results: dict[str, dict[str, Any]] = {}
    for name in args.systems:
        results[name] = run_system(name, args, out, model_cache)
        r = results[name]
        if "unavailable" in r:
            print(f"[serve_compare] {name}: unavailable: {r['unavailable']}", file=sys.stderr)
    workload = {k: getattr(args, k) for k in ("users", "duration", "restart_at", "min_later_turns",
                                              "source", "max_chars",
                                              "max_turns", "max_tokens", "think_time", "seed", "model",
                                              "dtype", "threads")}
    summary = {"workload": workload, "results": results, "goals": goals(results, args.restart_tolerance)}
    summary["tables"] = {n: system_rows(r) for n, r in results.items() if "unavailable" not in r}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    report = render(summary)
    (out / "report.md").write_text(report)
    print(report)
    print(f"(written to {out}/: summary.json, report.md, and each system's loadgen JSON and server log)",
          file=sys.stderr)
    ran = [r for r in results.values() if (r.get("loadgen") or {}).get("all", {}).get("turns")]
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
