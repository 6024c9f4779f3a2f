"""The peers chatkv is compared with: stock transformers and llama.cpp.

transformers (a second copy of the same weights on transformers' own SDPA attention):

* ``transformers re-prefill``: every turn prefills the whole history again
  (what an app without a KV cache does). This is the baseline of every ratio.
* ``transformers DynamicCache (hot)``: the history's ``DynamicCache`` kept in
  process memory; the turn prefills only the delta (lost on restart).
* ``transformers hand-made resume``: the ``DynamicCache`` tensors saved with
  safetensors; the turn loads the file, rebuilds the cache, prefills the delta.

llama.cpp (``llama-cpp-python`` on the same GGUF file; 4-bit weights):

* ``llama.cpp re-prefill`` (f16 KV): the whole history every turn.
* ``llama.cpp state file (<kv>)``: the context's state saved to a file after
  the history; the turn resets the context, loads the file, prefills the delta.
  At f16 and q8_0 KV (``type_k``/``type_v``; quantized V needs flash attention,
  so every llama.cpp context here uses it).

Every system feeds the same token ids (the chat template tokenized by the
transformers tokenizer, whose vocabulary is the GGUF's) and decodes greedily.
"""

from __future__ import annotations

import copy
import ctypes
import inspect
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from benchmarks.measure import Sample, Unavailable, idle_before_turn, raw_read, sample_for
from benchmarks.workload import Point

# --- transformers -----------------------------------------------------------------------


class HFModel:
    """A stock transformers copy of the benchmark model, driven with a ``DynamicCache``."""

    def __init__(self, model: Any) -> None:
        """Copy ``model`` (chatkv swaps the attention of the one it runs) onto SDPA attention."""
        self.model = copy.deepcopy(model)
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation("sdpa")
        else:
            self.model.config._attn_implementation = "sdpa"
        self.model.eval()
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    @torch.inference_mode()
    def step(self, ids: list[int], cache: Any) -> int:
        """Append ``ids`` to ``cache``; return the greedy next token."""
        x = torch.tensor([ids], dtype=torch.long)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return int(out.logits[0, -1].argmax())

    def turn(self, ids: list[int], cache: Any, new_tokens: int) -> tuple[float, float, list[int]]:
        """Prefill ``ids`` onto ``cache`` then decode ``new_tokens`` greedily.

        Returns:
            ``(seconds to the first token, seconds from first to last token, tokens)``.
        """
        t0 = time.perf_counter()
        tokens = [self.step(ids, cache)]
        t1 = time.perf_counter()
        while len(tokens) < new_tokens:
            tokens.append(self.step(tokens[-1:], cache))
        return t1 - t0, time.perf_counter() - t1, tokens


def crop(cache: Any, length: int) -> None:
    """Drop tokens past ``length`` from ``cache``."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def cache_tensors(cache: Any) -> dict[str, torch.Tensor]:
    """Every layer's keys and values as ``{"k.<i>", "v.<i>"}`` (``[1, kv_heads, T, head_dim]``)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        out[f"k.{i}"] = layer.keys.contiguous()
        out[f"v.{i}"] = layer.values.contiguous()
    return out


class HFReprefill:
    """transformers, re-prefilling the whole history every turn (the baseline)."""

    name = "transformers re-prefill"

    def __init__(self, hf: HFModel, new_tokens: int) -> None:
        """Answer turns with ``hf``, generating ``new_tokens`` each."""
        self.hf, self.new_tokens = hf, new_tokens

    def prepare(self, point: Point) -> None:
        """Nothing is kept between turns."""

    def measure(self, point: Point, repeat: int) -> Sample:
        """Prefill the whole prompt into a fresh cache, then decode."""
        cache = self.hf.new_cache()
        idle_before_turn()
        ttft, decode, tokens = self.hf.turn(list(point.prompt_ids), cache, self.new_tokens)
        return sample_for(self.name, point, repeat, ttft, decode, tokens)

    def release(self, point: Point) -> None:
        """Nothing to free."""


class HFHistory:
    """The history's ``DynamicCache`` for one point, shared by the two cache systems
    (built once per point by a prefill of the history, untimed)."""

    def __init__(self, hf: HFModel, workdir: Path) -> None:
        """Keep caches of ``hf`` and write saved ones under ``workdir``."""
        self.hf, self.workdir = hf, workdir
        self.key: str | None = None
        self.cache: Any = None
        self.file: Path | None = None

    def get(self, point: Point) -> Any:
        """The cache holding exactly ``point.cached_ids`` (built on first use)."""
        if self.key != point.key:
            self.cache = self.hf.new_cache()
            self.hf.step(list(point.cached_ids), self.cache)
            self.key, self.file = point.key, None
        crop(self.cache, point.n_cached)
        return self.cache

    def saved(self, point: Point) -> Path:
        """The safetensors file of the history's cache (written on first use)."""
        from safetensors.torch import save_file

        cache = self.get(point)
        if self.file is None:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.file = self.workdir / f"dynamic-cache-{point.key}.safetensors"
            save_file(cache_tensors(cache), str(self.file))
        return self.file

    def drop(self) -> None:
        """Free the cache and delete its file."""
        if self.file is not None:
            self.file.unlink(missing_ok=True)
        self.key = self.cache = self.file = None


class HFDynamicCache:
    """transformers with the history's ``DynamicCache`` kept in memory (hot)."""

    name = "transformers DynamicCache (hot)"

    def __init__(self, history: HFHistory, new_tokens: int) -> None:
        """Use the shared ``history`` caches; generate ``new_tokens`` per turn."""
        self.history, self.new_tokens = history, new_tokens

    def prepare(self, point: Point) -> None:
        """Prefill the history into a cache kept between turns."""
        self.history.get(point)

    def measure(self, point: Point, repeat: int) -> Sample:
        """Prefill the delta on the kept cache, decode, then crop it back."""
        cache = self.history.get(point)
        idle_before_turn()
        ttft, decode, tokens = self.history.hf.turn(point.delta_ids, cache, self.new_tokens)
        crop(cache, point.n_cached)
        return sample_for(self.name, point, repeat, ttft, decode, tokens)

    def release(self, point: Point) -> None:
        """Free the cache."""
        self.history.drop()


class HFHandmadeResume:
    """transformers resuming from its ``DynamicCache`` saved with safetensors
    (page cache warm: the file was just written)."""

    name = "transformers hand-made resume"

    def __init__(self, history: HFHistory, new_tokens: int) -> None:
        """Use the shared ``history`` caches; generate ``new_tokens`` per turn."""
        self.history, self.new_tokens = history, new_tokens

    def prepare(self, point: Point) -> None:
        """Save the history's cache to a safetensors file."""
        self.history.saved(point)

    def measure(self, point: Point, repeat: int) -> Sample:
        """Load the file, rebuild a ``DynamicCache``, prefill the delta, decode."""
        from safetensors.torch import load_file

        path = self.history.saved(point)
        hf = self.history.hf
        raw_read([path])  # in the page cache, as the row says (this VM's kernel pages out files idle a minute)
        idle_before_turn()
        t0 = time.perf_counter()
        tensors = load_file(str(path))
        cache = hf.new_cache()
        for i in range(len(tensors) // 2):
            cache.update(tensors[f"k.{i}"], tensors[f"v.{i}"], i)
        load_s = time.perf_counter() - t0
        ttft, decode, tokens = hf.turn(point.delta_ids, cache, self.new_tokens)
        return sample_for(self.name, point, repeat, load_s + ttft, decode, tokens, restore_s=load_s,
                          first_token_s=ttft,
                          state_bytes=path.stat().st_size)

    def release(self, point: Point) -> None:
        """Shared state is freed by :class:`HFDynamicCache`."""
        self.history.drop()


def transformers_systems(model: Any, new_tokens: int, workdir: Path) -> list[Any]:
    """The three transformers systems on a stock copy of ``model``."""
    hf = HFModel(model)
    history = HFHistory(hf, workdir)
    return [HFReprefill(hf, new_tokens), HFDynamicCache(history, new_tokens), HFHandmadeResume(history, new_tokens)]


# --- llama.cpp --------------------------------------------------------------------------


class LlamaCpp:
    """One ``llama_cpp.Llama`` context on a GGUF file, at one KV cache type."""

    KV_TYPES: ClassVar[dict[str, int]] = {"f16": 1, "q8_0": 8}  # ggml_type values

    def __init__(self, gguf: Path, kv: str, n_ctx: int, threads: int) -> None:
        """Open ``gguf`` with ``n_ctx`` tokens of ``kv`` cache on ``threads`` threads."""
        import llama_cpp

        self.llama_cpp = llama_cpp
        ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}", self.KV_TYPES[kv])
        self.kv = kv
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
            type_k=ggml_type, type_v=ggml_type, flash_attn=True, logits_all=False, verbose=False,
        )

    def eval(self, ids: list[int]) -> int:
        """Append ``ids`` to the context; return the greedy next token."""
        self.llm.eval(ids)
        # Without logits_all only the batch's last token has logits, at row 0.
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def turn(self, ids: list[int], new_tokens: int, t0: float | None = None) -> tuple[float, float, list[int]]:
        """Prefill ``ids`` then decode ``new_tokens`` greedily; times as :meth:`HFModel.turn`
        (from ``t0`` when given)."""
        t0 = time.perf_counter() if t0 is None else t0
        tokens = [self.eval(ids)]
        t1 = time.perf_counter()
        while len(tokens) < new_tokens:
            tokens.append(self.eval(tokens[-1:]))
        return t1 - t0, time.perf_counter() - t1, tokens

    def save_file(self, path: Path) -> int:
        """Write the context's state (KV of every evaluated token) to ``path``; returns its bytes."""
        lc = self.llm
        tokens = (self.llama_cpp.llama_token * lc.n_tokens)(*lc.input_ids[: lc.n_tokens].tolist())
        ok = self.llama_cpp.llama_state_save_file(lc.ctx, str(path).encode(), tokens, lc.n_tokens)
        if not ok:
            raise RuntimeError(f"llama_state_save_file({path}) failed")
        return path.stat().st_size

    def load_file(self, path: Path, capacity: int) -> int:
        """Reset the context and load the state at ``path``; returns the tokens restored."""
        lc = self.llm
        lc.reset()
        tokens = (self.llama_cpp.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        ok = self.llama_cpp.llama_state_load_file(lc.ctx, str(path).encode(), tokens, capacity,
                                                  ctypes.byref(n))
        if not ok:
            raise RuntimeError(f"llama_state_load_file({path}) failed")
        lc.input_ids[: n.value] = np.ctypeslib.as_array(tokens)[: n.value]
        lc.n_tokens = n.value
        return n.value


class LlamaReprefill:
    """llama.cpp re-prefilling the whole history every turn."""

    def __init__(self, ctx: LlamaCpp, new_tokens: int) -> None:
        """Answer turns on ``ctx``, generating ``new_tokens`` each."""
        self.ctx, self.new_tokens = ctx, new_tokens
        self.name = f"llama.cpp re-prefill ({ctx.kv})"

    def prepare(self, point: Point) -> None:
        """Nothing is kept between turns."""

    def measure(self, point: Point, repeat: int) -> Sample:
        """Reset the context, prefill the whole prompt, decode."""
        self.ctx.llm.reset()
        idle_before_turn()
        ttft, decode, tokens = self.ctx.turn(list(point.prompt_ids), self.new_tokens)
        return sample_for(self.name, point, repeat, ttft, decode, tokens)

    def release(self, point: Point) -> None:
        """Nothing to free."""


class LlamaStateFile:
    """llama.cpp resuming from a state file written after the history (page cache warm)."""

    def __init__(self, ctx: LlamaCpp, new_tokens: int, workdir: Path) -> None:
        """Answer turns on ``ctx``; state files go under ``workdir``."""
        self.ctx, self.new_tokens, self.workdir = ctx, new_tokens, workdir
        self.name = f"llama.cpp state file ({ctx.kv} KV)"
        self.path: Path | None = None
        self.bytes = 0

    def prepare(self, point: Point) -> None:
        """Prefill the history and save the context's state to a file."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / f"llama-{self.ctx.kv}-{point.key}.state"
        self.ctx.llm.reset()
        self.ctx.llm.eval(list(point.cached_ids))
        self.bytes = self.ctx.save_file(self.path)

    def measure(self, point: Point, repeat: int) -> Sample:
        """Load the state file, prefill the delta, decode."""
        assert self.path is not None
        idle_before_turn()
        t0 = time.perf_counter()
        n = self.ctx.load_file(self.path, point.n_cached + 8)
        load_s = time.perf_counter() - t0
        assert n == point.n_cached, (n, point.n_cached)
        ttft, decode, tokens = self.ctx.turn(point.delta_ids, self.new_tokens, t0=t0)
        return sample_for(self.name, point, repeat, ttft, decode, tokens, restore_s=load_s,
                          first_token_s=ttft - load_s,
                          state_bytes=self.bytes)

    def release(self, point: Point) -> None:
        """Delete the state file."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path = None


def llama_cpp_systems(gguf: Path | None, new_tokens: int, n_ctx: int, threads: int, workdir: Path,
                      kv_types: tuple[str, ...] = ("f16", "q8_0")) -> tuple[list[Any], list[Unavailable]]:
    """The llama.cpp systems, or why they cannot run (package missing, no GGUF...)."""
    names = ["llama.cpp re-prefill (f16)"] + [f"llama.cpp state file ({kv} KV)" for kv in kv_types]
    if gguf is None:
        return [], [Unavailable(n, "the model has no GGUF file (tiny models are built in memory)") for n in names]
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        reason = f"llama-cpp-python is not installed ({exc}); pip install llama-cpp-python"
        return [], [Unavailable(n, reason) for n in names]
    systems: list[Any] = []
    missing: list[Unavailable] = []
    for kv in kv_types:
        try:
            ctx = LlamaCpp(gguf, kv, n_ctx, threads)
        except Exception as exc:  # noqa: BLE001 -- a llama.cpp build without this KV type still runs the others
            missing.append(Unavailable(f"llama.cpp state file ({kv} KV)", f"{type(exc).__name__}: {exc}"))
            continue
        if kv == "f16":
            systems.append(LlamaReprefill(ctx, new_tokens))
        systems.append(LlamaStateFile(ctx, new_tokens, workdir))
    return systems, missing
