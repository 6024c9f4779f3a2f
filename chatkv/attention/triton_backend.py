"""The fused paged-attention backend: Triton kernels reading K/V straight from the pool.

Decode-only steps (every sequence brings one token) go to the split-K decode
kernel; every other step (prefill chunks, or prefill mixed with decode) goes to
the prefill kernel, which handles any chunk length. Neither gathers a
sequence's blocks into a contiguous copy.
"""

from __future__ import annotations

import torch

from chatkv.attention.base import AttentionBackend, AttentionMetadata
from chatkv.kernels import paged_attention as kernels


class TritonBackend(AttentionBackend):
    """Fused paged attention on CUDA (or on the CPU under ``TRITON_INTERPRET=1``).

    Args:
        num_splits: force the number of context parts of the decode kernel
            (1 disables split-K); None picks it per step from the batch shape.
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits

    @staticmethod
    def is_available(device: torch.device | str | None = None) -> bool:
        """True when Triton is importable and can run on ``device``.

        That is CUDA, or any device while Triton's CPU interpreter is on
        (``TRITON_INTERPRET=1``). With ``device`` None: whether CUDA or the
        interpreter is there at all.
        """
        if not kernels.HAS_TRITON:
            return False
        if kernels.interpreting():
            return True
        if device is None:
            return torch.cuda.is_available()
        return torch.device(device).type == "cuda"

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`.

        The cache must be full precision (float32, float16 or bfloat16), as the
        engine's pool always is.

        Returns:
            ``[T, q_heads, head_dim]`` in the query's dtype.
        """
        total = query.shape[0]
        assert total == sum(meta.query_lens_list), (query.shape, meta.query_lens_list)
        if meta.is_decode_only:
            assert total == meta.num_seqs, (total, meta.num_seqs)
            return kernels.paged_decode(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                sliding_window=sliding_window,
                max_seq_len=max(meta.seq_lens_list, default=0), num_splits=self.num_splits,
            )
        return kernels.paged_prefill(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            meta.max_query_len, scale, sliding_window=sliding_window,
        )
