"""Conversations longer than the context window: ``trim`` and ``sink`` against a
full re-prefill of the kept history (issue 16).

ShareGPT conversations are concatenated (each message cut to ``--max-chars``)
until the conversation is ``--windows`` times the window (``--window`` tokens,
``EngineConfig(max_context=...)``). It is replayed turn by turn, teacher-forced:
each turn appends the user message and the reference assistant reply. Three
systems see the same turns:

``re-prefill``
    stock transformers (SDPA) prefilling, every turn, exactly the messages
    ``trim`` keeps (the system prompt and the most recent whole turns) from
    scratch: the baseline a trimming chat app without a persistent cache pays.
``chatkv trim``
    ``context_policy="trim"``: the kept turns' KV is reused between trims; a
    trim re-prefills the kept turns once.
``chatkv sink``
    ``context_policy="sink"``: the first tokens and the most recent window stay
    cached; the oldest tokens after the sink are dropped and the kept keys
    shifted in place, so nothing is ever re-prefilled.

Per turn past the window (the history no longer fits): the time of the turn's
forward work (templating, alignment, prefill of what is not cached, including
the teacher-forced reply), and, at every reference reply token, whether the
model's top-1 next token equals it (top-1 agreement with the reference reply)
and equals what the re-prefill predicts (agreement with re-prefill). The table
gives means and ratios against the re-prefill.

Usage::

    python -m benchmarks.long_context --window 512 --windows 4
    python -m benchmarks.long_context --smoke          # tiny random model, seconds

``--out PATH`` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import write_json

SYSTEM = "You are a helpful assistant."
SYSTEMS = ("re-prefill", "chatkv trim", "chatkv sink")


@dataclass
class TurnResult:
    """One system's numbers for one turn."""

    turn: int
    past_window: bool
    seconds: float
    prefilled_tokens: int
    reply_tokens: int
    agree_reference: int
    agree_reprefill: int


@dataclass
class SystemResult:
    """One system's turns and summary."""

    system: str
    turns: list[TurnResult] = field(default_factory=list)

    def past(self) -> list[TurnResult]:
        """The turns past the window."""
        return [t for t in self.turns if t.past_window]

    def summary(self) -> dict[str, float]:
        """Means over the turns past the window."""
        past = self.past()
        tokens = sum(t.reply_tokens for t in past) or 1
        return {
            "turns": len(past),
            "mean_ms": 1000 * statistics.fmean(t.seconds for t in past) if past else 0.0,
            "median_ms": 1000 * statistics.median(t.seconds for t in past) if past else 0.0,
            "prefilled_per_turn": statistics.fmean(t.prefilled_tokens for t in past) if past else 0.0,
            "top1_reference": sum(t.agree_reference for t in past) / tokens,
            "top1_reprefill": sum(t.agree_reprefill for t in past) / tokens,
        }


def build_conversation(convs: list[list[dict[str, str]]], tokenizer: Any, target_tokens: int,
                       max_chars: int) -> list[dict[str, str]]:
    """Concatenate ``convs`` (each message cut to ``max_chars``) until the
    templated conversation has at least ``target_tokens`` tokens."""
    out: list[dict[str, str]] = []
    for conv in convs:
        pairs = [(conv[i], conv[i + 1]) for i in range(0, len(conv) - 1, 2)]
        for user, reply in pairs:
            for m in (user, reply):
                out.append({"role": m["role"], "content": m["content"][:max_chars].strip() or "..."})
            text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}] + out, tokenize=False)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= target_tokens:
                return out
    return out


def reply_targets(engine: Any, before: list[dict[str, str]], reply: dict[str, str]) -> list[int]:
    """The token ids a teacher-forced ``reply`` after ``before`` adds: its content and
    end-of-turn token (the template's last token, a newline, is left out).
    In the templated ids they end one token before the end, so the logits that
    predict them are rows ``[-(len + 2):-2]`` of a forward over those ids."""
    head = engine.encode_chat([{"role": "system", "content": SYSTEM}, before[-1]], add_generation_prompt=True)
    full = engine.encode_chat([{"role": "system", "content": SYSTEM}, before[-1], reply], add_generation_prompt=False)
    assert full[: len(head)] == head, "the chat template does not extend the prompt with the reply"
    return full[len(head):-1]


class Capture:
    """Patches the engine's runner so a single-sequence prefill also returns
    every position's logits (recorded), not only the last one."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.logits = engine, []
        self._real = engine.runner.forward
        engine.runner.forward = self._forward

    def _forward(self, batch: Any, all_logits: bool = False) -> torch.Tensor:
        if all_logits or len(batch) != 1:
            return self._real(batch, all_logits)
        out = self._real(batch, all_logits=True)
        self.logits.append(out)
        return out[-1:]

    def take(self) -> torch.Tensor:
        """The logits recorded since the last call, ``[tokens, vocab]``."""
        out, self.logits = torch.cat(self.logits), []
        return out


def run(model_spec: str | None, window: int, windows: float, max_chars: int, n_convs: int, seed: int,
        conversations: list[list[dict[str, str]]] | None = None, block_size: int = 16) -> dict[str, Any]:
    """Replay one long conversation through the three systems; returns the results as a dict."""
    from chatkv import Chat, EngineConfig
    from chatkv.engine import Engine
    from chatkv.models import load_model

    loaded = load_model(model_spec)
    if conversations is None:
        from benchmarks.sharegpt import load_conversations

        conversations = load_conversations(n=n_convs, seed=seed, min_turns=4)
    tok = loaded.tokenizer
    conv = build_conversation(conversations, tok, int(windows * window), max_chars)
    reference = copy.deepcopy(loaded.model)
    reference.set_attn_implementation("sdpa")
    reference.eval()
    engines = {name: Engine(loaded, EngineConfig(max_context=window, block_size=block_size,
                                                  kv_budget_bytes=256 << 20, compile=False))
               for name in ("chatkv trim", "chatkv sink")}
    chats = {name: Chat(f"long-{name.split()[-1]}", engine=engines[name], system=SYSTEM, persist=False,
                        context_policy=name.split()[-1]) for name in engines}
    captures = {name: Capture(engines[name]) for name in engines}
    results = {name: SystemResult(name) for name in SYSTEMS}
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    engine = engines["chatkv trim"]
    turn = 0
    for i in range(0, len(conv) - 1, 2):
        user, reply = conv[i], conv[i + 1]
        past = len(engine.encode_chat(history + [user, reply], add_generation_prompt=False)) > window
        targets = reply_targets(engine, history + [user], reply)
        # chatkv trim and sink: append the turn, teacher-forced, and read the reply positions' logits.
        preds: dict[str, torch.Tensor] = {}
        for name, chat in chats.items():
            started = time.perf_counter()
            stats = chat.append([user, reply])
            seconds = time.perf_counter() - started
            logits = captures[name].take()
            preds[name] = logits[-(len(targets) + 2):-2].argmax(-1)
            results[name].turns.append(TurnResult(turn, past, seconds, stats.prefilled_tokens, len(targets),
                                                  0, 0))
        # The re-prefill baseline: stock transformers on exactly what trim kept.
        kept = [m.as_dict() for m in chats["chatkv trim"].history if not m.outside]
        ids = engine.encode_chat(kept, add_generation_prompt=False)
        started = time.perf_counter()
        with torch.inference_mode():
            out = reference(torch.tensor([ids], device=loaded.device), use_cache=False).logits[0]
        seconds = time.perf_counter() - started
        base = out[-(len(targets) + 2):-2].argmax(-1).cpu()
        want = torch.tensor(targets)
        results["re-prefill"].turns.append(TurnResult(turn, past, seconds, len(ids), len(targets),
                                                      int((base == want).sum()), len(targets)))
        for name in chats:
            got = preds[name].cpu()
            n = min(len(got), len(want))
            r = results[name].turns[-1]
            r.agree_reference = int((got[:n] == want[:n]).sum())
            r.agree_reprefill = int((got[:n] == base[:n]).sum())
        history += [user, reply]
        turn += 1
    shift = chats["chatkv sink"]._session.kv.seq.shift
    for chat in chats.values():
        chat.close()
    total_tokens = len(engine.encode_chat(history, add_generation_prompt=False))
    return {
        "model": loaded.name, "window": window, "conversation_tokens": total_tokens, "turns": turn,
        "sink_dropped_tokens": shift.dropped if shift is not None else 0,
        "systems": {name: {"summary": r.summary(), "turns": [asdict(t) for t in r.turns]}
                    for name, r in results.items()},
    }


def table(results: dict[str, Any]) -> str:
    """The results as a Markdown table with ratios against the re-prefill."""
    systems = results["systems"]
    base = systems["re-prefill"]["summary"]
    lines = [
        f"{results['model']}, window {results['window']} tokens, one conversation of "
        f"{results['conversation_tokens']} tokens ({results['turns']} turns, "
        f"{base['turns']} past the window):",
        "",
        "| system | turns past window | mean ms/turn | median ms/turn | vs re-prefill | prefilled tokens/turn "
        "| top-1 = reference reply | top-1 = re-prefill |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in SYSTEMS:
        s = systems[name]["summary"]
        ratio = s["mean_ms"] / base["mean_ms"] if base["mean_ms"] else float("nan")
        lines.append(f"| {name} | {s['turns']} | {s['mean_ms']:.1f} | {s['median_ms']:.1f} | {ratio:.2f}x "
                     f"| {s['prefilled_per_turn']:.0f} | {s['top1_reference']:.3f} | {s['top1_reprefill']:.3f} |")
    return "\n".join(lines)


def _smoke_conversations() -> list[list[dict[str, str]]]:
    words = "cache keys values pages blocks disk tiers resume prefill decode tokens window sink shift".split()
    conv = []
    for i in range(40):
        conv.append({"role": "user", "content": f"question {i}: why " + " ".join(words[i % 7: i % 7 + 6]) + "?"})
        conv.append({"role": "assistant", "content": f"answer {i}: " + " ".join(words[i % 5: i % 5 + 8]) + "."})
    return [conv]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; prints the table (and writes ``--out`` JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--window", type=int, default=512, help="context window (EngineConfig.max_context)")
    parser.add_argument("--windows", type=float, default=4.0, help="conversation length, in windows")
    parser.add_argument("--max-chars", type=int, default=300, help="cut every message to this many characters")
    parser.add_argument("--conversations", type=int, default=40, help="ShareGPT conversations to draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, synthetic turns, a small window")
    args = parser.parse_args(argv)
    if args.smoke:
        results = run("tiny:llama", 256, 3.0, 200, 0, 0, conversations=_smoke_conversations(), block_size=4)
    else:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
        results = run(args.model, args.window, args.windows, args.max_chars, args.conversations, args.seed)
    print(table(results))
    write_json(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
