"""Fused GPU kernels (Triton). Importable without Triton: check ``HAS_TRITON``."""

from chatkv.kernels.paged_attention import (
    CACHE_DTYPES,
    HAS_TRITON,
    choose_num_splits,
    interpreting,
    paged_decode,
    paged_prefill,
)

__all__ = [
    "CACHE_DTYPES",
    "HAS_TRITON",
    "choose_num_splits",
    "interpreting",
    "paged_decode",
    "paged_prefill",
]
