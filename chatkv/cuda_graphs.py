"""Decode steps replayed from CUDA graphs, one graph per batch size.

On a GPU a decode step of a small model is bound by kernel launches, not by
the GPU: SmolLM2's 30 layers launch about 600 kernels per step, each costing
tens of microseconds of Python and driver time, while the GPU's own work for
a token is far shorter. A CUDA graph records a whole step's launches once and
replays them with one call, as vLLM, SGLang and nano-vllm do for decode. On an
H200 that took a SmolLM2-shaped step from 40 ms to 3 ms
(``benchmarks/decode_batch.py --device cuda``).

A graph replays the same kernels on the same memory, so everything a decode
step reads lives in static buffers that this module owns: the token ids,
their positions, the slots their K/V go to, the block tables (as wide as the
longest sequence the engine admits) and the context lengths. A step copies
its metadata into them and replays; the logits come out of the graph's own
output buffer, copied before the next replay can overwrite them. The pool
tensor is the engine's own, whose address never changes. The decode kernel's
number of context splits is fixed at capture, chosen for the longest context;
splits past a shorter sequence's end are empty and weigh nothing.

The engine captures a graph per size of ``EngineConfig.compile_batch_sizes``
on its loop, after its warm-up. A decode step of fewer sequences than a
captured size runs padded, as the compiled CPU step does
(:meth:`chatkv.runner.ModelRunner.pad_step`); every other step (prefill,
teacher forcing, a batch larger than every size, a table wider than the
buffers) runs the model as it is. Capture needs the fused Triton backend:
the ``torch`` and ``flex`` backends size their work from Python integers of
each step, which a graph would freeze. Where capture fails, decode runs as it
is and the log says why.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from chatkv.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

#: The attention backend a captured step needs (see the module docstring).
GRAPH_BACKEND = "triton"


def graphs_unavailable(device: torch.device, backend: AttentionBackend) -> str | None:
    """None if decode steps can be captured as CUDA graphs on ``device`` with
    ``backend``, else why not (for the log)."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if backend.name != GRAPH_BACKEND:
        return (f"CUDA graphs need the {GRAPH_BACKEND} attention backend "
                f"(this engine uses {backend.name!r})")
    return None


class CudaDecodeGraphs:
    """The model's decode step captured for a few batch sizes over static buffers.

    Built on the engine's loop (:meth:`capture`, which runs the model); the
    runner calls :meth:`run` on the loop for the steps :meth:`size_for` covers.
    With ``use_graphs=False`` nothing is captured and :meth:`run` calls the
    model over the same static buffers: what the tests use to check the
    buffers' bookkeeping where there is no GPU (the kernels then run in
    Triton's interpreter).
    """

    def __init__(self, model: Any, batch_sizes: tuple[int, ...], max_context: int, block_size: int,
                 use_graphs: bool = True) -> None:
        """Prepare to capture ``model``'s decode step for ``batch_sizes``
        sequences of at most ``max_context`` tokens in blocks of ``block_size``."""
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_sizes!r}")
        self.model = model
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        #: Columns of the static block table: a step whose table is wider runs as it is.
        self.max_blocks = -(-max_context // block_size)
        self.max_context = self.max_blocks * block_size
        self.use_graphs = use_graphs
        #: The batch sizes captured so far.
        self.ready: frozenset[int] = frozenset()
        self._replay: dict[int, Callable[[], torch.Tensor]] = {}
        self._kv: torch.Tensor | None = None

    @torch.inference_mode()
    def capture(self, pool_kv: torch.Tensor, backend: AttentionBackend, pad_block: int, pad_slot: int) -> int:
        """Capture a graph per batch size (largest first, all in one memory
        pool), each after one run of the step to let Triton and cuBLAS choose
        their kernels. Every row of those runs writes and reads only
        ``pad_slot`` of ``pad_block``, a block no sequence uses. Runs on the
        loop that owns the pool; returns how many sizes are ready. Raises
        whatever capturing raises (nothing is installed then)."""
        if pool_kv.device.type == "cuda":
            with torch.cuda.device(pool_kv.device):  # graphs and their memory pool on the pool's GPU
                return self._capture(pool_kv, backend, pad_block, pad_slot)
        return self._capture(pool_kv, backend, pad_block, pad_slot)

    def _capture(self, pool_kv: torch.Tensor, backend: AttentionBackend, pad_block: int, pad_slot: int) -> int:
        device = pool_kv.device
        widest = max(self.batch_sizes)
        self._ids = torch.zeros((1, widest), dtype=torch.long, device=device)
        self._positions = torch.zeros((1, widest), dtype=torch.long, device=device)
        self._slots = torch.full((widest,), pad_slot, dtype=torch.int64, device=device)
        self._tables = torch.full((widest, self.max_blocks), pad_block, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(widest, dtype=torch.int32, device=device)
        self._kv = pool_kv
        memory = torch.cuda.graph_pool_handle() if self.use_graphs else None
        replay: dict[int, Callable[[], torch.Tensor]] = {}
        for b in sorted(self.batch_sizes, reverse=True):
            started = time.perf_counter()
            meta = AttentionMetadata(
                kv=pool_kv,
                slot_mapping=self._slots[:b],
                block_tables=self._tables[:b],
                seq_lens=self._seq_lens[:b],
                cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=device),
                # Python lengths are read once, at capture: the split count is chosen
                # for the longest context, and the graph keeps it.
                seq_lens_list=[self.max_context] * b,
                query_lens_list=[1] * b,
                max_query_len=1,
                backend=backend,
            )
            meta.extras["contiguous_start"] = [-1] * b

            def step(meta: AttentionMetadata = meta, b: int = b) -> torch.Tensor:
                return self.model(input_ids=self._ids[:, :b], position_ids=self._positions[:, :b],
                                  use_cache=False, logits_to_keep=0, chatkv_meta=meta).logits

            step()  # kernels chosen and compiled outside the capture
            if self.use_graphs:
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory):
                    out = step()
                torch.cuda.synchronize(device)
                replay[b] = lambda graph=graph, out=out: (graph.replay(), out)[1]
            else:
                replay[b] = step
            log.info("captured the decode step for %d sequence(s) in %.3f s", b, time.perf_counter() - started)
        self._replay = replay
        self.ready = frozenset(replay)
        return len(replay)

    def size_for(self, meta: AttentionMetadata) -> int | None:
        """The captured batch size this step replays as: a decode step of
        ``B`` sequences whose tables fit the static buffers replays the graph
        of the smallest captured size ``>= B`` (padded by the caller when
        larger); None for any other step."""
        if not self.ready or meta.max_query_len != 1 or meta.kv is not self._kv:
            return None
        if meta.block_tables.shape[1] > self.max_blocks:
            return None
        return min((b for b in self.ready if b >= meta.num_seqs), default=None)

    def run(self, meta: AttentionMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The step's logits ``[1, B, vocab]`` (a copy of the graph's output):
        ``meta``'s tensors are copied into the static buffers, then the graph
        of ``B = meta.num_seqs`` (a captured size) is replayed."""
        b = meta.num_seqs
        width = meta.block_tables.shape[1]
        self._ids[:, :b].copy_(input_ids, non_blocking=True)
        self._positions[:, :b].copy_(position_ids, non_blocking=True)
        self._slots[:b].copy_(meta.slot_mapping, non_blocking=True)
        self._seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        # Columns past a row's blocks keep stale block ids: the kernel reads no
        # block past its sequence's length.
        self._tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        return self._replay[b]().clone()
