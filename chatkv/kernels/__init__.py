"""Fused GPU kernels (Triton). Importable without Triton: check ``HAS_TRITON``."""

from chatkv.kernels.paged_attention import (
    HAS_TRITON,
    QUANTIZED_DTYPES,
    choose_num_splits,
    interpreting,
    paged_decode,
    paged_prefill,
)

__all__ = [
    "HAS_TRITON",
    "QUANTIZED_DTYPES",
    "choose_num_splits",
    "interpreting",
    "paged_decode",
    "paged_prefill",
]
