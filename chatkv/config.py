"""Engine and sampling configuration: small dataclasses that reject unknown keys."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TypeVar

from chatkv.errors import ConfigError

T = TypeVar("T")


def _from_dict(cls: type[T], values: dict[str, Any]) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s) {unknown}; valid keys are {sorted(names)}"
        )
    return cls(**values)


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name``, a switch that is on unless
    set, turns it off: ``0``, ``off``, ``false`` or ``no`` (any case, spaces
    around ignored)."""
    return os.environ.get(name, "").strip().lower() in ("0", "off", "false", "no")


def chatkv_home() -> Path:
    """The directory chatkv keeps its state in: ``$CHATKV_HOME``, else the user data dir.

    The same rule as :func:`chatkv.storage.default_home`, restated here so that
    loading a model never imports the index (SQLAlchemy), e.g. on a GPU host
    that only runs the kernels.
    """
    env = os.environ.get("CHATKV_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("chatkv", appauthor=False))


def model_cache_dir() -> Path:
    """Where converted models are kept: ``$CHATKV_MODEL_CACHE``, else ``<home>/models``."""
    env = os.environ.get("CHATKV_MODEL_CACHE")
    return Path(env).expanduser() if env else chatkv_home() / "models"


#: Tokens of the engine's warm-up prefill (about a first turn's system prompt and question).
WARMUP_PROMPT_TOKENS = 128
#: One-token decode steps of the warm-up.
WARMUP_DECODE_STEPS = 4
#: Then the warm-up runs a returning conversation's turn: this many tokens of
#: history whose KV is written into the pool (not computed: its values do not
#: matter), a prefill of :data:`WARMUP_DELTA_TOKENS` new tokens over them, and
#: decode steps. A first prefill over a cached history ran 4 to 6 ms slower
#: than later ones until the warm-up ran one (a fresh prefill does not cover it).
#: Past position 2,048 (and so past where a bfloat16 model on the CPU attends
#: by products, 1,024), so that the turn runs those products once, over
#: buffers as large as a long conversation's (:data:`chatkv.attention.torch_backend.PRODUCTS_FROM_POSITION`).
WARMUP_CONTEXT_TOKENS = 2112
#: New tokens of that turn (about a short user message and its template).
WARMUP_DELTA_TOKENS = 24
#: The warm-up runs every linear layer's shape for steps of 1 to this many new
#: tokens (a chat turn's typical delta), so a first prefill of such a length
#: finds its oneDNN kernels built (:func:`chatkv.prepack.warm_row_counts`).
WARMUP_LINEAR_ROWS = 128
#: ... and the output projection for steps of up to this many sequences.
WARMUP_HEAD_ROWS = 8
#: Bytes of a host pool's first blocks the warm-up writes once, so that a first
#: restore or prefill finds their pages committed: a restore into fresh pages
#: ran at 1.2 GB/s here, into committed ones at 4.6 GB/s. 512 MB holds a whole
#: 8k-token SmolLM2 window in float32 (377 MB); writing it takes about 130 ms
#: of the background warm-up here (see :meth:`chatkv.block_pool.BlockPool.commit_pages`).
WARMUP_POOL_BYTES = 512 << 20


@dataclass
class EngineConfig:
    """How an engine lays out and sizes its KV pool.

    Attributes:
        block_size: tokens per KV block (a power of two).
        kv_budget_bytes: bytes the block pool may take on the device; None picks a
            default (a quarter of free RAM capped at 2 GiB on CPU, 60% of free
            memory on CUDA).
        num_blocks: overrides ``kv_budget_bytes`` with an exact block count.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; None picks CUDA when present.
        attention_backend: ``"torch"``, ``"triton"``, ``"flex"`` or ``"auto"``
            (triton on CUDA when importable, torch otherwise).
        max_prefill_tokens: prefill tokens one scheduler step takes across all
            turns (decode tokens first); longer deltas are split into chunks so
            activations stay bounded and decoding sessions are not stalled.
        max_num_seqs: the most sequences one batched step runs (turns beyond
            it wait their turn).
        max_waiting: the most turns waiting to start; more raise
            :class:`~chatkv.errors.QueueFullError`.
        block_wait_s: how long a turn that cannot fit in the pool, even with
            every other turn in flight preempted, waits for blocks to free up
            (sessions closing, idle ones demoted) before it fails with
            :class:`~chatkv.errors.OutOfBlocksError`.
        max_context: cap the context window below the model's (for memory, or
            so a test can outgrow a window quickly); None is the model's own.
        dtype: the dtype a model loaded for this engine runs in (weights and
            KV): ``"float32"``, ``"bfloat16"``, ``"float16"`` (or ``fp32``,
            ``bf16``, ``fp16``), or ``"auto"``/None: ``$CHATKV_DTYPE`` if set,
            else bfloat16 on a CPU with native bf16 (AVX-512 BF16, AMX) or a
            CUDA device, float32 elsewhere (:mod:`chatkv.hardware`). An engine
            built on an already loaded model takes that model's dtype, and
            refuses an explicit ``dtype`` that differs from it.
        warmup: run a throwaway turn (a prefill of :data:`WARMUP_PROMPT_TOKENS`
            tokens and a few decode steps) on the loop as soon as the engine
            exists, in the background, so that the first real turn does not
            pay for first-call costs (thread pool start, kernel selection and
            compilation, allocator growth, the chat template's compilation,
            the first :data:`WARMUP_POOL_BYTES` of a host pool's pages, the
            oneDNN kernels of steps of up to :data:`WARMUP_LINEAR_ROWS` tokens).
            A turn asked for meanwhile starts once it is done. After it and
            the compile, a throwaway session in a temporary store rehearses
            the whole path of a returning turn a few times (saved, reopened
            from disk, a short turn: :meth:`chatkv.session.SessionManager.rehearse`;
            ``CHATKV_REHEARSAL=0`` leaves it out).
        prepack: pack the weights of the model's linear layers once for
            oneDNN on the CPU (:mod:`chatkv.prepack`; about 1.2x faster decode
            steps in bfloat16 and float32 here), where the ops exist and agree
            with ``F.linear``; ``CHATKV_PREPACK=0`` turns it off everywhere. A
            model another engine packed stays packed.
        compile: compile the model's decode step with ``torch.compile``
            (:mod:`chatkv.compile`; about 1.2x faster decode on this project's
            CPU): ``"auto"`` (None: ``$CHATKV_COMPILE``, else auto) on the CPU
            where Inductor and a C++ compiler are present, ``"on"``/True
            wherever Inductor is, ``"off"``/False never. Compiling runs in the
            background after the warm-up (:meth:`Engine.wait_warm` waits for
            it too); steps run uncompiled until it is done, and where it fails.
            On CUDA, ``"auto"`` and ``"on"`` capture the decode step as CUDA
            graphs instead (:mod:`chatkv.cuda_graphs`; needs the ``triton``
            attention backend), on the loop after the warm-up.
        compile_batch_sizes: the decode batch sizes (sequences in one step) that
            get a compiled graph (or a CUDA graph) each; a smaller step runs
            padded through the next larger size, a larger one uncompiled.
        compile_prefill: where the decode step is compiled (CPU), also compile
            the prefill step of one sequence, one graph whose token count is
            symbolic (:class:`chatkv.compile.PrefillGraph`; about 1.13x faster
            prefill of a chat turn's new message on this project's CPU). It is
            built after the decode graphs, in the same background thread.
        adapt_threads: on the CPU, fit the number of threads the loop runs
            the model on to the cores other processes leave free
            (:class:`chatkv.threads.ThreadGovernor`: a core another process
            keeps busy would otherwise slow every step several times over).
            None: ``$CHATKV_ADAPT_THREADS``, on unless it is ``0``. The loop
            sets the count with ``torch.set_num_threads``, which is also what
            threads started later in the process begin with.
        cpu_attention: how a bfloat16 model attends on the CPU: ``"auto"``
            (None: ``$CHATKV_CPU_ATTENTION``, else auto) by two bfloat16
            matrix products, as transformers' eager attention computes, for
            every position from 1,024 on (there a returning turn's prefill
            step takes 0.7x to 0.85x its time through SDPA on this project's
            CPU, a decode step 0.75x to 0.91x from 1.5k tokens; earlier
            positions keep SDPA, whose decode step is the cheaper there);
            ``"sdpa"`` through SDPA's flash kernel everywhere, whose scores
            stay in float32 (:mod:`chatkv.attention.torch_backend`).
        restore_policy: how a session that comes back from disk gets its KV:
            ``"auto"`` (None: ``$CHATKV_RESTORE_POLICY``, else auto) reads it
            back or lets the next turn recompute it, whichever the engine's
            measured disk bandwidth and prefill rate predict is faster
            (:mod:`chatkv.costs`); ``"restore"`` always reads it;
            ``"recompute"`` never does.
        tiers: the memory-tier policy (budgets, idle times, quantization) of
            the engine's sessions; None is :class:`TierConfig`'s defaults. It is
            engine-wide; :meth:`chatkv.engine.Engine.configure_tiers` changes it.
    """

    block_size: int = 16
    kv_budget_bytes: int | None = None
    num_blocks: int | None = None
    device: str | None = None
    attention_backend: str = "auto"
    max_prefill_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting: int = 1024
    block_wait_s: float = 1.0
    tiers: "TierConfig | None" = None
    max_context: int | None = None
    dtype: str | None = None
    warmup: bool = True
    prepack: bool = True
    compile: str | bool | None = None
    compile_batch_sizes: tuple[int, ...] = (1,)
    compile_prefill: bool = True
    adapt_threads: bool | None = None
    cpu_attention: str | None = None
    restore_policy: str | None = None

    def __post_init__(self) -> None:
        if self.cpu_attention is not None:
            from chatkv.attention.torch_backend import resolve_cpu_attention

            resolve_cpu_attention(self.cpu_attention)
        if self.restore_policy is not None:
            from chatkv.costs import resolve_policy

            resolve_policy(self.restore_policy)
        if isinstance(self.tiers, dict):
            self.tiers = TierConfig.from_dict(self.tiers)
        if self.dtype is not None and self.dtype != "auto":
            from chatkv.hardware import parse_dtype

            parse_dtype(self.dtype)
        if self.compile is not None:
            from chatkv.compile import parse_compile

            parse_compile(self.compile)
        self.compile_batch_sizes = tuple(self.compile_batch_sizes)
        if not all(isinstance(b, int) and b >= 1 for b in self.compile_batch_sizes):
            raise ConfigError(f"compile_batch_sizes must be positive integers, got {self.compile_batch_sizes!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context must be at least 2 tokens, got {self.max_context}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ConfigError(f"kv_budget_bytes must be positive, got {self.kv_budget_bytes}")
        if self.attention_backend not in ("auto", "torch", "triton", "flex"):
            raise ConfigError(
                "attention_backend must be 'auto', 'torch', 'triton' or 'flex', "
                f"got {self.attention_backend!r}"
            )
        if self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_waiting < 1:
            raise ConfigError(f"max_waiting must be positive, got {self.max_waiting}")
        if self.block_wait_s < 0:
            raise ConfigError(f"block_wait_s must be >= 0, got {self.block_wait_s}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from a mapping; unknown keys raise :class:`ConfigError` naming them."""
        return _from_dict(cls, values)


#: The compact ``TierConfig.disk_format`` values (besides ``exact``): :mod:`chatkv.quant` schemes.
SCHEMES_OF_DISK = ("bf16", "fp16", "int8", "fp8", "int4")


@dataclass
class TierConfig:
    """Budgets and policies of an engine's memory tiers. Times are seconds of idleness.

    Attributes:
        device_budget_bytes: KV bytes allowed on the device (pool blocks in use
            plus quantized tensors); None means the pool's capacity.
        host_budget_bytes: KV bytes allowed in host RAM.
        quant_scheme: ``none``, ``int8``, ``fp8`` or ``int4``: how idle sessions
            are compressed in the quantized and host tiers.
        quantize_after_s / offload_after_s / spill_after_s: idle time after which
            a session moves to the quantized / host / disk tier (None: never by time).
        kv_ttl_s: idle time after which stored KV expires (history stays).
        disk_budget_bytes: chunk bytes allowed on disk (enforced by the store gc).
        maintenance_interval_s: run the policies in a background thread this often
            (None: only under pressure, or when maintenance is asked for).
        store_gc_interval_s: with the background thread, also enforce the disk
            policy (KV TTL, disk budget, orphan files) on the stores the engine's
            sessions use, this often.
        fidelity_floors: minimum teacher-forced top-1 agreement per scheme.
        disk_format: how KV chunks are written to disk: ``exact`` (the KV as
            computed, the default: a restored session answers exactly as a
            fresh one), or a compact scheme, ``bf16``, ``fp16``, ``int8``,
            ``fp8`` or ``int4`` (quantized with :mod:`chatkv.quant`; full blocks
            only, the partial last block stays exact), used only while it
            passes its fidelity floor for the model (else the next finer one).
            ``bf16`` and ``fp16`` of a model whose KV is already two bytes a
            value (bfloat16) would save nothing: its chunks are written exact.
    """

    device_budget_bytes: int | None = None
    host_budget_bytes: int = 1 << 30
    quant_scheme: str = "none"
    quantize_after_s: float | None = None
    offload_after_s: float | None = None
    spill_after_s: float | None = None
    kv_ttl_s: float | None = None
    disk_budget_bytes: int | None = None
    maintenance_interval_s: float | None = None
    store_gc_interval_s: float | None = None
    fidelity_floors: dict[str, float] = field(
        default_factory=lambda: {"bf16": 0.98, "fp16": 0.99, "int8": 0.99, "fp8": 0.98, "int4": 0.90}
    )
    disk_format: str = "exact"

    def __post_init__(self) -> None:
        from chatkv.quant import check_scheme

        try:
            check_scheme(self.quant_scheme)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.disk_format != "exact" and self.disk_format not in SCHEMES_OF_DISK:
            raise ConfigError(f"disk_format must be one of exact, {', '.join(SCHEMES_OF_DISK)}; "
                              f"got {self.disk_format!r}")
        for name in ("device_budget_bytes", "host_budget_bytes", "disk_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.maintenance_interval_s is not None and self.maintenance_interval_s <= 0:
            raise ConfigError(f"maintenance_interval_s must be positive, got {self.maintenance_interval_s}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TierConfig":
        """Build from a mapping; unknown keys raise :class:`ConfigError` naming them."""
        return _from_dict(cls, values)

    def replace(self, **changes: Any) -> "TierConfig":
        """A copy with ``changes`` applied (unknown keys raise :class:`ConfigError`)."""
        merged = dataclasses.asdict(self)
        merged.update(changes)
        return _from_dict(TierConfig, merged)


@dataclass
class SamplingParams:
    """How the next token is chosen, and when generation stops.

    ``temperature == 0`` is greedy decoding (the default). ``top_k == 0`` and
    ``top_p == 1`` disable those filters. ``seed`` makes sampling reproducible.
    Generation stops at the model's end-of-sequence token(s), at any of the
    ``stop`` strings (which are not included in the reply), or after
    ``max_new_tokens``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a mapping; unknown keys raise :class:`ConfigError` naming them."""
        return _from_dict(cls, values)

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes`` applied (unknown keys raise :class:`ConfigError`)."""
        merged = dataclasses.asdict(self)
        merged.update(changes)
        return _from_dict(SamplingParams, merged)
