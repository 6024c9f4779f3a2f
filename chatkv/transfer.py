"""Copies between the device and host memory that do not stall other work.

On CUDA, offloads go to pinned host buffers and both directions run on a side
stream, so other sessions keep decoding on the default stream while a session
moves; an event marks when each copy is done. Elsewhere the copies are plain.
"""

from __future__ import annotations

import threading

import torch

_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_LOCK = threading.Lock()


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The copy stream for a CUDA ``device`` (created once), or None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _STREAMS[index] = stream
        return stream


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors into (pinned, on CUDA) host memory.

    On CUDA the copies run on the side stream after the work already queued on
    the current stream (so they read finished KV), and this call returns once
    they are complete: the caller may then free or reuse the source blocks.
    Only this thread waits; the default stream keeps running other sessions.
    """
    if not tensors or not tensors[0].is_cuda:
        return [t if t.device.type == "cpu" else t.to("cpu") for t in tensors]
    stream = side_stream(tensors[0].device)
    assert stream is not None
    stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)
            out.append(host)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return out


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy host tensors to ``device``. On CUDA the copies run on the side stream
    and the current stream is made to wait for them (no host synchronisation)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    stream = side_stream(device)
    assert stream is not None
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            src = t if t.is_pinned() or t.is_cuda else t.pin_memory()
            out.append(src.to(device, non_blocking=True))
        done = torch.cuda.Event()
        done.record(stream)
    current = torch.cuda.current_stream(device)
    current.wait_event(done)
    for t in out:
        t.record_stream(current)
    return out
