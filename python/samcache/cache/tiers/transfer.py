"""Loading a cached item's KV from host memory into pool slots, layer by layer, off the critical
path: the model computes layer l while layers l+1.. are still on their way, and a step waits only
for the layer it is about to run (:meth:`LayerLoad.wait`), never for the whole transfer.

- CPU caches: the native :class:`samcache._C.TransferEngine` (worker threads copying the rows of
  each layer in order, publishing per-layer progress).
- CUDA caches: a side stream per engine, the host KV (pinned) copied and scattered into the
  caches on it (one copy per layer, then one scatter each for K and V), one event per layer;
  ``wait(l)`` makes the compute stream wait for layer l's event (the host never blocks: every
  host buffer is pinned, dtype conversions run on the GPU).

``LayerLoad.copy_seconds`` (worker time) against ``waited_seconds`` (time the step blocked) says
how much load time was hidden behind compute. On CUDA both are measured on the GPU's clock, with
timing events read when the load is released: the side stream's time from the load's start to its
last layer, and for each ``wait(l)`` how long the compute stream stood still (from where it
reached the wait to the end of layer l's copy, if later).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from samcache._checks import check_int
from samcache.ops.host_arrays import upload


class LayerLoad:
    """One load in flight: ``kv`` ([layers, 2, n, kv_heads, head_dim]) into ``slots`` of every
    layer's K and V cache. Keeps the host tensor alive until released."""

    def __init__(self, engine: "TransferEngine", job: Any, keep: Any, num_layers: int) -> None:
        self._engine, self._job, self._keep = engine, job, keep
        self.num_layers = num_layers
        self.waited_seconds = 0.0
        self._released = False
        self._copy_seconds = 0.0

    def wait(self, layer: int) -> None:
        """Return once ``layer``'s KV is in place (CUDA: once the current stream waits for it)."""
        if self._released:
            return
        check_int("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer {layer} is outside the load's {self.num_layers} layers")
        start = time.perf_counter()
        self._engine._wait(self._job, layer)
        if not self._engine.cuda:
            self.waited_seconds += time.perf_counter() - start

    def wait_all(self) -> None:
        self.wait(self.num_layers - 1)

    @property
    def copy_seconds(self) -> float:
        return self._copy_seconds if self._released else self._engine._job_seconds(self._job)

    def release(self) -> None:
        """Wait for the whole load and let the host tensor go (idempotent)."""
        if self._released:
            return
        self.wait_all()
        self._copy_seconds = self._engine._job_seconds(self._job)
        if self._engine.cuda:
            self.waited_seconds = self._engine._stall_seconds(self._job)
        self._engine._release(self._job)
        self._released = True
        self._keep = None


class TransferEngine:
    """Loads into a runner's paged caches (``k_cache`` / ``v_cache``: ``[layers, blocks,
    block_size, kv_heads, head_dim]``, CPU or CUDA)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_threads: int = 1) -> None:
        if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
            raise ValueError("k_cache and v_cache must have the same shape, dtype and device")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the caches must be contiguous")
        self.k_cache, self.v_cache = k_cache, v_cache
        self.num_layers = int(k_cache.shape[0])
        self.rows_per_layer = int(k_cache.shape[1] * k_cache.shape[2])
        self.row_shape = tuple(k_cache.shape[3:])
        self.cuda = k_cache.device.type == "cuda"
        if self.cuda:
            self._stream = torch.cuda.Stream(device=k_cache.device)
            self._jobs: dict[int, list] = {}
            self._next = 0
        else:
            from samcache import _C

            self._native = _C.TransferEngine(check_int("num_threads", num_threads, 1))

    def load(self, kv: torch.Tensor, slots: np.ndarray) -> LayerLoad:
        """Start copying ``kv`` ([layers, 2, len(slots), kv_heads, head_dim]) into ``slots`` of
        every layer. The slots must be distinct; the caller keeps them allocated until the load is
        released."""
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.size
        want = (self.num_layers, 2, n, *self.row_shape)
        if tuple(kv.shape) != want:
            raise ValueError(f"kv must be {want}, got {tuple(kv.shape)}")
        if n and (slots.min() < 0 or slots.max() >= self.rows_per_layer):
            raise ValueError(f"slots must be in [0, {self.rows_per_layer})")
        if np.unique(slots).size != n:
            raise ValueError("slots must be distinct")
        if self.cuda:
            return self._load_cuda(kv, slots)
        kv = kv.to(dtype=self.k_cache.dtype, device="cpu").contiguous()
        row_bytes = int(np.prod(self.row_shape)) * kv.element_size()
        # Runs of consecutive slots are one copy each (a block's rows are contiguous).
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(order) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64) if n else np.zeros(0, dtype=np.int64)
        lengths = np.diff(np.concatenate([starts, [n]]))
        src_rows, dst_rows = order[starts], s[starts]
        layers = []
        layer_bytes = self.rows_per_layer * row_bytes
        for layer in range(self.num_layers):
            spans = []
            for cache, which in ((self.k_cache, 0), (self.v_cache, 1)):
                src0 = kv[layer, which].data_ptr()
                dst0 = cache.data_ptr() + layer * layer_bytes
                spans.append(np.stack([src0 + src_rows * row_bytes, dst0 + dst_rows * row_bytes,
                                       lengths * row_bytes], axis=1))
            layers.append(np.ascontiguousarray(np.concatenate(spans).astype(np.int64)))
        job = self._native.submit(layers)
        return LayerLoad(self, job, kv, self.num_layers)

    def _load_cuda(self, kv: torch.Tensor, slots: np.ndarray) -> LayerLoad:
        # One host->device copy per layer (the layer's K and V rows are one contiguous piece of kv),
        # then one scatter each for K and V. Every host buffer is pinned: a copy from pageable memory
        # (or a dtype conversion on the host, which makes one) would make the host wait for the side
        # stream, which waits for the compute stream. Dtypes are converted on the GPU.
        device = self.k_cache.device
        if kv.device.type == "cuda":
            src = kv
        else:
            src = kv if kv.is_pinned() and kv.is_contiguous() else kv.contiguous().pin_memory()
        flat = (self.num_layers, self.rows_per_layer, *self.row_shape)
        k_flat, v_flat = self.k_cache.view(flat), self.v_cache.view(flat)
        events = []
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the slots' blocks are allocated
        begin = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record(self._stream)
            index, = upload([slots], np.int64, device)  # pinned, on the side stream
            for layer in range(self.num_layers):
                part = src[layer].to(device, non_blocking=True)
                if part.dtype != self.k_cache.dtype:
                    part = part.to(self.k_cache.dtype)
                k_flat[layer].index_copy_(0, index, part[0])
                v_flat[layer].index_copy_(0, index, part[1])
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self._stream)
                events.append(ev)
        job = self._next
        self._next += 1
        self._jobs[job] = [events, begin, []]  # [per-layer ends, start, (reached, layer) per wait]
        return LayerLoad(self, job, (src, index), self.num_layers)

    # ---- what LayerLoad calls --------------------------------------------------------------------
    def _wait(self, job: Any, layer: int) -> None:
        if self.cuda:
            compute = torch.cuda.current_stream(self.k_cache.device)
            reached = torch.cuda.Event(enable_timing=True)
            reached.record(compute)  # where the compute stream got to when it needed layer l
            self._jobs[job][2].append((reached, layer))
            compute.wait_event(self._jobs[job][0][layer])
        else:
            self._native.wait(job, layer)

    def _job_seconds(self, job: Any) -> float:
        if self.cuda:  # GPU clock: from the load's start to its last layer (synchronizes on it)
            events, begin, _ = self._jobs[job]
            events[-1].synchronize()
            return begin.elapsed_time(events[-1]) / 1000
        return self._native.job_seconds(job)

    def _stall_seconds(self, job: Any) -> float:
        """CUDA: how long the compute stream stood still in this load's waits (GPU clock)."""
        events, _, waits = self._jobs[job]
        stall = 0.0
        for reached, layer in waits:
            reached.synchronize()
            events[layer].synchronize()
            stall += max(0.0, reached.elapsed_time(events[layer]) / 1000)  # copy ended after the stream got there
        return stall

    def _release(self, job: Any) -> None:
        if self.cuda:
            self._jobs[job][0][-1].synchronize()  # the host tensor may go only after the copy
            del self._jobs[job]
        else:
            self._native.release(job)

    def stats(self) -> dict:
        """jobs, layers, bytes, copy_seconds, wait_seconds (CPU; on CUDA: jobs in flight)."""
        if self.cuda:
            return {"jobs_in_flight": len(self._jobs)}
        return dict(self._native.stats())


__all__ = ["LayerLoad", "TransferEngine"]
