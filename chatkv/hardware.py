"""Which dtype the model and its KV run in: bfloat16 where the hardware computes it fast, else float32.

On a CPU, bfloat16 matrix products are only fast with native instructions
(AVX-512 BF16 or AMX): there a bf16 copy of SmolLM2 prefills about three
times faster than fp32, and its KV takes half the bytes in every tier.
Without them, oneDNN emulates bf16 and fp32 is the better choice. On CUDA,
bfloat16 where the device supports it.

``EngineConfig(dtype=...)``, ``--dtype`` and ``$CHATKV_DTYPE`` choose
explicitly; ``"auto"`` (or unset) is :func:`default_dtype`. The dtype is part
of the model's fingerprint, so a cache made in one dtype is never used by the
other.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from chatkv.errors import ConfigError

DTYPE_ENV = "CHATKV_DTYPE"

#: CPU feature flags (as ``/proc/cpuinfo`` names them) of native bfloat16 arithmetic.
FAST_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

#: Accepted names (``--dtype``, ``EngineConfig.dtype``, ``$CHATKV_DTYPE``) and the dtypes they mean.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """True if the CPU (or the given ``flags``) computes bfloat16 natively (AVX-512 BF16 or AMX)."""
    return bool((cpu_flags() if flags is None else flags) & FAST_BF16_FLAGS)


def default_dtype(device: str | torch.device | None = None, flags: frozenset[str] | None = None) -> torch.dtype:
    """The dtype chatkv runs a model in on ``device`` unless told otherwise.

    bfloat16 on a CUDA device that supports it and on a CPU with native
    bfloat16 (``flags``, default this CPU's); float32 everywhere else.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if dev.type == "cpu" and sys.byteorder == "little" and cpu_has_fast_bf16(flags):
        return torch.bfloat16
    return torch.float32


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """The dtype a name means (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``).

    Raises:
        ConfigError: another name or dtype.
    """
    if isinstance(value, torch.dtype):
        if value in DTYPE_NAMES.values():
            return value
        raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {value}")
    try:
        return DTYPE_NAMES[value.strip().lower()]
    except (KeyError, AttributeError):
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {value!r}") from None


def resolve_dtype(value: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """The dtype to load a model in: ``value`` if it names one, else ``$CHATKV_DTYPE``
    if set, else :func:`default_dtype` for ``device`` (``"auto"`` means the same).

    Raises:
        ConfigError: an unknown name (in ``value`` or the environment).
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        value = os.environ.get(DTYPE_ENV) or "auto"
        if value.strip().lower() == "auto":
            return default_dtype(device)
    return parse_dtype(value)
