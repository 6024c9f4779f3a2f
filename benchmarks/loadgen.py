"""A load generator for any OpenAI-compatible chat server: N users holding
multi-turn conversations at once, through the official ``openai`` client.

Each simulated user takes a conversation (ShareGPT V3 by default, the same
ones for every server with the same ``--seed``), sends its first user
message, reads the streamed reply, waits a think time (exponential, mean
``--think-time`` seconds, seeded), then sends the whole history plus the
next user message, as an OpenAI client does, until the conversation's user
turns or ``--max-turns`` run out; then it starts its next conversation. The
history holds the server's own replies (``--history model``, what a real
client sends), or the recorded ShareGPT replies (``--history recorded``: the
same prompts for every server, whatever it generates). Nothing but the
standard chat-completions API is used, so the same command drives
``chatkv serve``, llama.cpp's server, vLLM, SGLang or ``transformers serve``.

Reported, for all turns and for turns after each conversation's first (where
a server that keeps KV across turns should shine): time to first token
p50/p90/p99, inter-token latency p50/p99 (between streamed chunks), output
tokens/s, turns/s, and the cached-token fraction
(``usage.prompt_tokens_details.cached_tokens`` over ``prompt_tokens``, for
servers that report it). With ``--restart-at S --restart-cmd CMD`` the
command (which must restart the server) runs ``S`` seconds in; turns that fail
meanwhile are retried once the server answers again, and the report splits
into before and after the restart.

``--min-later-turns N`` keeps users going past ``--duration`` until N later
turns (a conversation's second or after; after the restart, with one) have
succeeded, at most ``--request-timeout`` seconds more: a short run then
measures some however slow the server was to answer or to come back.

Usage::

    chatkv serve --model default --port 8000 &
    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000/v1 --users 16 --duration 120

    # llama.cpp's server (pip install 'llama-cpp-python[server]'), same GGUF file:
    python -m llama_cpp.server --model $(python -c 'from chatkv.models import default_gguf_path; print(default_gguf_path())') \\
        --port 8001 --n_ctx 8192
    python -m benchmarks.loadgen --base-url http://127.0.0.1:8001/v1 --users 16 --duration 120

    # vLLM (on a GPU host):  vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8002
    # transformers:          transformers serve --continuous-batching --port 8003
    python -m benchmarks.loadgen --base-url http://127.0.0.1:8002/v1 --model HuggingFaceTB/SmolLM2-135M-Instruct

Only ``openai`` (and the standard library) is needed to run it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYNTHETIC_TOPICS = ["a KV cache", "paged attention", "disk tiers", "continuous batching", "quantized keys",
                    "prefix sharing", "restarts", "session leases"]


@dataclass
class Turn:
    """One request as the client saw it."""

    user: int
    conversation: int
    index: int  # the turn's position in its conversation (0: the first)
    started: float  # seconds since the run began
    ok: bool
    ttft_s: float | None = None
    total_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    after_restart: bool = False
    error: str | None = None


def synthetic_conversations(n: int, seed: int, turns: int = 6) -> list[list[dict[str, str]]]:
    """``n`` made-up conversations (no data needed), each ``turns`` user messages long."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = rng.choice(SYNTHETIC_TOPICS)
        conv = []
        for t in range(turns):
            conv.append({"role": "user", "content": f"Question {t} of conversation {i}: tell me about {topic}, "
                                                    f"in {rng.randint(2, 6)} sentences."})
            conv.append({"role": "assistant", "content": f"Here is what I know about {topic} ({t})."})
        out.append(conv)
    return out


def load_source(source: str, n: int, seed: int, max_chars: int | None) -> list[list[dict[str, str]]]:
    """Conversations from ``sharegpt`` (the ShareGPT V3 wheel), ``synthetic``, or a JSON file of them."""
    if source == "synthetic":
        return synthetic_conversations(n, seed)
    if source == "sharegpt":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.sharegpt import load_conversations

        return load_conversations(n=n, seed=seed, min_turns=4, max_chars=max_chars)
    convs = json.loads(Path(source).read_text(encoding="utf-8"))
    if not isinstance(convs, list) or not all(isinstance(c, list) for c in convs):
        raise SystemExit(f"{source}: expected a JSON list of conversations (lists of {{role, content}})")
    return convs


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``, or None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def summarize(turns: list[Turn], seconds: float) -> dict[str, Any]:
    """The report's numbers for ``turns`` over ``seconds`` of wall time."""
    ok = [t for t in turns if t.ok]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    itl = [x for t in ok for x in t.itl_s]
    prompt = sum(t.prompt_tokens or 0 for t in ok if t.cached_tokens is not None)
    cached = sum(t.cached_tokens or 0 for t in ok if t.cached_tokens is not None)
    out_tokens = sum(t.completion_tokens for t in ok)

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 2)

    return {
        "turns": len(ok), "errors": len(turns) - len(ok), "seconds": round(seconds, 3),
        "turns_per_s": round(len(ok) / seconds, 3) if seconds > 0 else None,
        "output_tokens_per_s": round(out_tokens / seconds, 2) if seconds > 0 else None,
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p90": ms(percentile(ttft, 90)),
                    "p99": ms(percentile(ttft, 99)),
                    "mean": ms(statistics.fmean(ttft)) if ttft else None},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99))},
        "prompt_tokens": sum(t.prompt_tokens or 0 for t in ok), "completion_tokens": out_tokens,
        "cached_fraction": round(cached / prompt, 4) if prompt else None,
    }


class LoadGen:
    """The run: users, their conversations, and every turn's measurements."""

    def __init__(self, args: argparse.Namespace, conversations: list[list[dict[str, str]]]) -> None:
        from openai import AsyncOpenAI

        self.args = args
        self.conversations = conversations
        self.client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                                  timeout=args.request_timeout)
        self.turns: list[Turn] = []
        self.t0 = 0.0
        self.restarted_at: float | None = None
        self.restart_began: float | None = None
        #: Seconds the server was down for its restart: users go on that much longer.
        self.downtime = 0.0
        self.server_up = asyncio.Event()
        self.server_up.set()
        self.next_conversation = 0
        self.model = ""
        #: Later turns (a conversation's second or after) that succeeded; after the restart, with one.
        self.later_ok = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start_limit(self) -> float:
        """Seconds into the run after which no turn starts: ``--duration`` plus
        the restart's downtime, plus ``--request-timeout`` with ``--min-later-turns``."""
        extra = self.args.request_timeout if self.args.min_later_turns else 0.0
        return self.args.duration + self.downtime + extra

    def over(self) -> bool:
        """True once ``--duration`` seconds of serving (the restart's downtime not
        counted) have passed and ``--min-later-turns`` later turns have
        succeeded (or :meth:`start_limit` has passed)."""
        now = self.now()
        if now < self.args.duration + self.downtime:
            return False
        return self.later_ok >= self.args.min_later_turns or now >= self.start_limit()

    async def pick_model(self) -> str:
        if self.args.model:
            return self.args.model
        models = await self.client.models.list()
        return models.data[0].id

    async def one_turn(self, user: int, conv: int, index: int, messages: list[dict[str, str]],
                       session: str | None) -> tuple[Turn, str]:
        args = self.args
        turn = Turn(user, conv, index, self.now(), ok=False, after_restart=self.restarted_at is not None)
        start = time.perf_counter()
        last: float | None = None
        pieces: list[str] = []
        extra: dict[str, Any] = {}
        if session is not None:
            extra["extra_headers"] = {"X-Session-ID": session}
        if args.ignore_eos:
            extra["extra_body"] = {"ignore_eos": True}
        try:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=args.max_tokens, temperature=args.temperature,
                seed=args.seed, stream=True, stream_options={"include_usage": True}, **extra)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    if turn.ttft_s is None:
                        turn.ttft_s = now - start
                    elif last is not None:
                        turn.itl_s.append(now - last)
                    last = now
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    turn.prompt_tokens = chunk.usage.prompt_tokens
                    turn.completion_tokens = chunk.usage.completion_tokens or 0
                    details = chunk.usage.prompt_tokens_details
                    turn.cached_tokens = details.cached_tokens if details is not None else None
            if turn.prompt_tokens is None:  # a server without usage in streams: count chunks
                turn.completion_tokens = len(pieces)
            if not pieces and turn.prompt_tokens is None:
                turn.error = "an empty stream (no content, no usage)"
            else:
                turn.ok = True
        except Exception as exc:  # recorded, not raised: a load test reports failures
            turn.error = f"{type(exc).__name__}: {exc}"[:300]
        turn.total_s = time.perf_counter() - start
        self.turns.append(turn)
        if turn.ok and index > 0 and (turn.after_restart or not args.restart_cmd):
            self.later_ok += 1
        return turn, "".join(pieces)

    async def user_loop(self, user: int) -> None:
        args = self.args
        rng = random.Random(args.seed * 1000 + user)
        while not self.over():
            conv_index = self.next_conversation % len(self.conversations)
            self.next_conversation += 1
            recorded = self.conversations[conv_index]
            session = f"loadgen-{args.seed}-{user}-{conv_index}-{self.next_conversation}" \
                if args.session_header else None
            history: list[dict[str, str]] = []
            if args.system:
                history.append({"role": "system", "content": args.system})
            users = [i for i, m in enumerate(recorded) if m["role"] == "user"][:args.max_turns]
            for index, at in enumerate(users):
                if self.over():
                    return
                history.append({"role": "user", "content": recorded[at]["content"]})
                for attempt in range(args.retries + 1):
                    await self.server_up.wait()
                    turn, reply = await self.one_turn(user, conv_index, index, list(history), session)
                    if turn.ok or self.over():
                        break
                    await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
                if not turn.ok:
                    break  # give the conversation up
                if args.history == "recorded" and at + 1 < len(recorded):
                    reply = recorded[at + 1]["content"]
                history.append({"role": "assistant", "content": reply or "(empty)"})
                if args.think_time > 0:
                    await asyncio.sleep(rng.expovariate(1.0 / args.think_time))

    async def restart(self) -> None:
        args = self.args
        await asyncio.sleep(args.restart_at)
        print(f"[loadgen] {self.now():.1f}s: restarting the server: {args.restart_cmd}", file=sys.stderr)
        self.server_up.clear()
        self.restart_began = self.now()
        proc = await asyncio.create_subprocess_shell(args.restart_cmd)
        await proc.wait()
        for _ in range(600):  # the server is back when it lists its models (bounded: 60 s)
            try:
                await self.client.models.list()
                break
            except Exception:
                await asyncio.sleep(0.1)
        self.downtime = self.now() - self.restart_began
        print(f"[loadgen] {self.now():.1f}s: server back after {self.downtime:.1f} s down "
              f"(restart command exit {proc.returncode}); users go on {self.downtime:.1f} s longer",
              file=sys.stderr)
        self.restarted_at = self.now()
        self.server_up.set()

    async def run(self) -> dict[str, Any]:
        self.model = await self.pick_model()
        self.t0 = time.perf_counter()
        tasks = [asyncio.create_task(self.user_loop(u)) for u in range(self.args.users)]
        restart = asyncio.create_task(self.restart()) if self.args.restart_cmd else None
        try:
            while True:  # the limit grows by the restart's downtime
                limit = self.start_limit() + self.args.request_timeout - self.now()
                done, _ = await asyncio.wait(tasks, timeout=max(limit, 0.1))
                if len(done) == len(tasks) or (self.now() >= self.start_limit() + self.args.request_timeout
                                                and self.server_up.is_set()):
                    break
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if not all(t.done() for t in tasks):
                raise asyncio.TimeoutError
        except asyncio.TimeoutError:
            for t in tasks:
                t.cancel()
        if restart is not None and not restart.done():
            restart.cancel()
        seconds = self.now()
        await self.client.close()
        return self.report(seconds)

    def report(self, seconds: float) -> dict[str, Any]:
        turns = self.turns
        out: dict[str, Any] = {
            "base_url": self.args.base_url, "model": self.model, "users": self.args.users,
            "duration_s": self.args.duration, "min_later_turns": self.args.min_later_turns,
            "max_tokens": self.args.max_tokens, "seed": self.args.seed,
            "history": self.args.history, "source": self.args.source,
            "all": summarize(turns, seconds),
            "later_turns": summarize([t for t in turns if t.index > 0], seconds),
            "first_turns": summarize([t for t in turns if t.index == 0], seconds),
        }
        if self.restarted_at is not None:
            before = [t for t in turns if not t.after_restart]
            after = [t for t in turns if t.after_restart]
            out["before_restart"] = summarize([t for t in before if t.index > 0], self.restart_began or self.restarted_at)
            out["after_restart"] = summarize([t for t in after if t.index > 0], max(seconds - self.restarted_at, 1e-9))
        errors = [t.error for t in turns if t.error]
        out["error_samples"] = sorted(set(errors))[:5]
        return out


def format_report(report: dict[str, Any]) -> str:
    """The report as a small text table."""
    lines = [f"loadgen: {report['base_url']} model={report['model']} users={report['users']} "
             f"duration={report['duration_s']}s max_tokens={report['max_tokens']} history={report['history']}"]
    head = f"{'turns':<14}{'ok':>6}{'err':>5}{'turns/s':>9}{'out tok/s':>10}{'TTFT p50':>10}{'p90':>8}" \
           f"{'p99':>8}{'ITL p50':>9}{'p99':>8}{'cached':>8}"
    lines.append(head)
    for key in ("all", "first_turns", "later_turns", "before_restart", "after_restart"):
        s = report.get(key)
        if s is None:
            continue

        def f(x: Any, w: int) -> str:
            return f"{'-' if x is None else x:>{w}}"

        cached = "-" if s["cached_fraction"] is None else f"{100 * s['cached_fraction']:.0f}%"
        lines.append(f"{key:<14}{s['turns']:>6}{s['errors']:>5}{f(s['turns_per_s'], 9)}"
                     f"{f(s['output_tokens_per_s'], 10)}{f(s['ttft_ms']['p50'], 10)}{f(s['ttft_ms']['p90'], 8)}"
                     f"{f(s['ttft_ms']['p99'], 8)}{f(s['itl_ms']['p50'], 9)}{f(s['itl_ms']['p99'], 8)}{cached:>8}")
    lines.append("(times in ms; cached = usage.prompt_tokens_details.cached_tokens / prompt_tokens)")
    if report.get("error_samples"):
        lines.append("errors: " + " | ".join(report["error_samples"]))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                   help="the server's OpenAI base URL [env OPENAI_BASE_URL]")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="[env OPENAI_API_KEY]")
    p.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    p.add_argument("--users", type=int, default=16, help="concurrent users (conversations in flight)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds during which turns start")
    p.add_argument("--max-turns", type=int, default=6, help="user turns per conversation at most")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each reply")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send vLLM's ignore_eos extension (fixed-length replies; chatkv and vLLM accept it)")
    p.add_argument("--think-time", type=float, default=1.0, help="mean seconds a user waits between turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default="sharegpt", help="sharegpt, synthetic, or a JSON file of conversations")
    p.add_argument("--conversations", type=int, default=200, help="conversations to draw from the source")
    p.add_argument("--max-chars", type=int, default=6000, help="cut ShareGPT conversations to this many characters")
    p.add_argument("--system", default="You are a helpful assistant.", help="system prompt ('' for none)")
    p.add_argument("--history", choices=["model", "recorded"], default="model",
                   help="assistant turns in the history: the server's replies, or ShareGPT's recorded ones")
    p.add_argument("--session-header", action="store_true",
                   help="send X-Session-ID per conversation (chatkv's explicit sessions)")
    p.add_argument("--retries", type=int, default=3, help="retries of a failed turn")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--restart-at", type=float, default=None, help="run --restart-cmd this many seconds in")
    p.add_argument("--restart-cmd", default=None, help="shell command that restarts the server")
    p.add_argument("--min-later-turns", type=int, default=0,
                   help="go on past --duration until this many later turns (after the restart, with one) "
                        "have succeeded, at most --request-timeout seconds more [0]")
    p.add_argument("--json-out", type=Path, default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    if (args.restart_at is None) != (args.restart_cmd is None):
        p.error("--restart-at and --restart-cmd go together")
    if args.users < 1 or args.duration <= 0 or args.max_turns < 1:
        p.error("--users, --duration and --max-turns must be positive")
    if args.min_later_turns < 0:
        p.error("--min-later-turns must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the load and print the report; 0 if at least one turn succeeded."""
    args = parse_args(argv)
    convs = load_source(args.source, args.conversations, args.seed, args.max_chars)
    if not convs:
        print("loadgen: no conversations to replay", file=sys.stderr)
        return 1
    report = asyncio.run(LoadGen(args, convs).run())
    print(format_report(report))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0 if report["all"]["turns"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
