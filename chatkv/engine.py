"""The engine: one loaded model, its block pool and runner, and generation.

``Engine.generate`` hands a sequence to the engine's scheduler
(:mod:`chatkv.scheduler`), which prefills its uncomputed tokens in chunks on
top of its cached blocks and then decodes it, batched with every other turn in
flight, and streams its text pieces back. Every pool mutation and forward pass
happens under the engine's lock, so other code (a session aligning its cache,
persistence, the tier manager) can take it too.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from chatkv.attention import get_backend
from chatkv.block_pool import BlockPool
from chatkv.config import EngineConfig, SamplingParams
from chatkv.errors import ContextWindowExceededError
from chatkv.models import LoadedModel, load_model
from chatkv.runner import ModelRunner, StepInput
from chatkv.scheduler import Scheduler
from chatkv.sequence import Sequence


@dataclass
class GenerationResult:
    """What one generation produced, filled in while it streams."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos", "stop", "length", "context", "interrupted"
    prefilled_tokens: int = 0
    ttft_s: float | None = None
    decode_s: float = 0.0
    preemptions: int = 0  # times the scheduler released its KV under memory pressure
    recomputed_tokens: int = 0  # tokens computed again after preemptions

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one (None with fewer than two tokens)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.6)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail // 4, 2 << 30))


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


class Engine:
    """A model with its paged KV pool, ready to prefill and decode sequences.

    Attributes:
        loaded: the model, tokenizer and fingerprint.
        pool: the block pool (one per engine).
        lock: held for every pool mutation and forward pass.
        sessions: in-process sessions by id (used by :class:`chatkv.Chat`).
        scheduler: batches every turn in flight into shared forward passes.
        reclaimer: None, or a callable the scheduler calls (from its thread,
            without ``lock`` held) with a number of blocks it wants available
            when a step is short of blocks, before it preempts a turn in flight.
            The tier manager can bind it to demote idle sessions.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        """Size and allocate the block pool for ``loaded`` and attach paged attention."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        cfg = loaded.model.config
        device = torch.device(self.config.device) if self.config.device else loaded.device
        if device != loaded.device:
            loaded.model.to(device)
        self.device = device
        num_layers = cfg.num_hidden_layers
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = loaded.dtype
        per_block = BlockPool.bytes_per_block_for(num_layers, kv_heads, head_dim, self.config.block_size, dtype)
        num_blocks = self.config.num_blocks or max(
            1, (self.config.kv_budget_bytes or _default_budget(device)) // per_block
        )
        self.pool = BlockPool(num_blocks, self.config.block_size, num_layers, kv_heads, head_dim,
                              dtype, device, loaded.fingerprint)
        self.backend = get_backend(self.config.attention_backend, device)
        self.runner = ModelRunner(loaded.model, self.pool, self.backend)
        self.eos_ids = _eos_ids(loaded)
        self.lock = threading.RLock()
        self.sessions: dict[str, Any] = {}
        self.reclaimer: Callable[[int], Any] | None = None
        self.scheduler = Scheduler(self)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.loaded.tokenizer

    @property
    def max_context(self) -> int:
        """The longest sequence the model accepts."""
        return self.loaded.max_context

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` under the model's chat template: the ids a
        session's KV must cover (the template is rendered, then tokenized without
        extra special tokens)."""
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def prefill(self, seq: Sequence) -> tuple[torch.Tensor, int]:
        """Compute KV for every token of ``seq`` past ``num_computed``, in chunks of
        at most ``config.max_prefill_tokens``, in the caller's thread (outside the
        scheduler; :meth:`generate` is what batches).

        Returns:
            ``(logits of the last token [vocab], number of tokens prefilled)``.
        """
        todo = len(seq.token_ids) - seq.num_computed
        assert todo > 0, "nothing to prefill: the last token must be uncomputed"
        step = self.config.max_prefill_tokens
        logits = None
        while seq.num_computed < len(seq.token_ids):
            start = seq.num_computed
            chunk = seq.token_ids[start : start + step]
            with self.lock:
                logits = self.runner.forward([StepInput(seq, chunk)])[0]
        assert logits is not None
        return logits, todo

    def generate(self, seq: Sequence, params: SamplingParams, result: GenerationResult | None = None
                 ) -> Iterator[str]:
        """Prefill ``seq``'s uncomputed tokens, then decode, yielding text pieces.

        The turn is queued to :attr:`scheduler`, which runs it batched with every
        other turn in flight; this generator yields the pieces it produces, in
        the caller's thread. Sampled tokens are appended to ``seq.token_ids``;
        the last one (EOS or the final token) is left uncomputed. ``seq`` belongs
        to the scheduler until the generator ends: the caller must not touch it
        meanwhile (``Chat`` allows one turn per session at a time). ``result``
        (if given) is complete when the generator ends, including when the
        consumer stops early (``close()``, garbage collection) or is interrupted
        (``KeyboardInterrupt``): the turn is then cancelled at the next step and
        ``finish_reason`` is ``"interrupted"``, with what was generated so far
        kept: exactly the pieces the consumer took (tokens the engine ran ahead
        with are dropped, their KV too).

        Raises:
            ContextWindowExceededError: the prompt alone leaves no room to generate.
            QueueFullError: ``config.max_waiting`` turns are already waiting to start.
            OutOfBlocksError: the turn cannot fit in the pool even with every
                other turn in flight preempted.
        """
        result = result if result is not None else GenerationResult()
        if len(seq.token_ids) >= self.max_context:
            raise ContextWindowExceededError(
                f"the conversation is {len(seq.token_ids)} tokens; the model's context window is "
                f"{self.max_context}"
            )
        request = self.scheduler.submit(seq, params, result)
        yield from self.scheduler.stream(request)


_ENGINES: dict[tuple, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def get_engine(model: str | LoadedModel | None = None, config: EngineConfig | None = None) -> Engine:
    """The process-wide engine for a model spec (loaded on first use, then shared).

    ``model`` is a spec for :func:`chatkv.models.load_model` or an already
    loaded model. Engines are keyed by the spec (or object) and config, so every
    ``Chat`` on the same model shares one pool and its prefix cache.
    """
    key = (id(model) if isinstance(model, LoadedModel) else (model or "default"), repr(config))
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            loaded = model if isinstance(model, LoadedModel) else load_model(model)
            engine = Engine(loaded, config)
            _ENGINES[key] = engine
        return engine
