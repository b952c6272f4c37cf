"""The plugin's counters, kept by each engine's worker-side connector: what it reused, recomputed
and saved.

vLLM runs its workers in other processes than the caller's; ``metrics_path`` (extra config) makes
the worker rewrite these counters as JSON after every step that reused or saved an image, and
:func:`read_metrics` reads them back.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass

from samcache.reuse import ReuseCounters


@dataclass
class PluginMetrics(ReuseCounters):
    """The shared reuse counters (vLLM computes every scheduled token's budget; ``computed_tokens``
    is what the plugin let it compute), plus the worker's gauges."""

    store_bytes: int = 0
    store_evictions: int = 0
    num_layers: int = 0            # decoder layers of the model (to weigh per-layer recompute)
    vit_kernel_sequences: int = 0  # long ViT attention sequences run on samcache's kernel


class WorkerMetrics:
    """One worker-side connector's counters. Each engine's connector keeps its own, so that engines
    run one after another in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) count apart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics = PluginMetrics()

    def snapshot(self) -> PluginMetrics:
        with self._lock:
            return PluginMetrics(**asdict(self._metrics))

    def update(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self._metrics, name, getattr(self._metrics, name) + int(value))

    def set_gauges(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self._metrics, name, int(value))

    def write(self, path: str) -> None:
        """Atomically replace ``path`` with the counters as JSON."""
        data = asdict(self.snapshot())
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> PluginMetrics:
    """The counters a worker wrote to ``path`` (all zero if it has not written yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return PluginMetrics(**json.load(f))
    except FileNotFoundError:
        return PluginMetrics()
