"""What an engine plugin of samcache is told: how much of a reused image to recompute, how big the
image-KV store is, the default tenant and where to write metrics. The vLLM plugin reads these from
``kv_connector_extra_config``, the SGLang plugin from ``SAMCACHE_SGLANG``; both are checked at
start-up, so a typo or a value out of range stops the server with a message naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from samcache._checks import check_fraction, check_int


@dataclass(frozen=True)
class ReuseSettings:
    """``recompute_ratio``: fraction of a reused image's tokens recomputed at every layer (0: none,
    1: all, i.e. outputs equal the engine's own prefill); ``recompute_rates``: per-layer fractions
    instead (non-increasing with depth, one per decoder layer; overrides the ratio);
    ``head_fraction``: share of each image's quota spent on its first tokens (track 1);
    ``store_bytes``: byte bound of the image-KV store (least recently used images go first);
    ``tenant``: the tenant of requests that name none (each engine says how a request names its
    own); ``metrics_path``: a JSON file the worker rewrites after every step that reused or saved
    images (the counters of :mod:`samcache.integrations.vllm.metrics`);
    ``eviction_policy``: what the store lets go first: "lru" (default), "priority-lru" or
    "workflow" (KVFlow: the images of the agents that run soonest stay; ``eviction_options``
    ``{"workflows": [{"name": "team", "agents": ["planner", "worker", "reviewer"]}]}``, and each
    request names its agent: :mod:`samcache.integrations.store_policy`)."""

    recompute_ratio: float = 0.05
    recompute_rates: tuple[float, ...] | None = None
    head_fraction: float = 0.1
    store_bytes: int = 1 << 30
    tenant: str = "default"
    metrics_path: str | None = None
    eviction_policy: str = "lru"
    eviction_options: Mapping[str, Any] | None = None

    @classmethod
    def from_mapping(cls, extra: Mapping[str, Any] | None, *, source: str):
        """The settings in ``extra``; ``source`` names where they came from in error messages."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"samcache: unknown {source} key(s) {unknown}; "
                             f"known keys: {sorted(known)}")
        ratio = check_fraction("samcache: recompute_ratio", extra.get("recompute_ratio", cls.recompute_ratio))
        rates = extra.get("recompute_rates")
        if rates is not None:
            if isinstance(rates, (str, bytes)) or not hasattr(rates, "__iter__"):
                raise ValueError(f"samcache: recompute_rates must be a list of numbers in [0, 1], got {rates!r}")
            rates = tuple(check_fraction("samcache: recompute_rates[i]", r) for r in rates)
            if not rates or any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"samcache: recompute_rates must be non-empty and non-increasing with depth, "
                                 f"got {list(rates)}")
        head = check_fraction("samcache: head_fraction", extra.get("head_fraction", cls.head_fraction))
        store = check_int("samcache: store_bytes", extra.get("store_bytes", cls.store_bytes), 1)
        tenant = extra.get("tenant", cls.tenant)
        if not isinstance(tenant, str):
            raise ValueError(f"samcache: tenant must be a string, got {tenant!r}")
        path = extra.get("metrics_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"samcache: metrics_path must be a non-empty string, got {path!r}")
        policy = extra.get("eviction_policy", cls.eviction_policy)
        options = extra.get("eviction_options")
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"samcache: eviction_options must be an object, got {options!r}")
        out = cls(recompute_ratio=ratio, recompute_rates=rates, head_fraction=head, store_bytes=store,
                  tenant=tenant, metrics_path=path, eviction_policy=policy,
                  eviction_options=dict(options) if options is not None else None)
        out.make_policy()  # a bad name or option stops the server now
        return out

    def make_policy(self):
        """A fresh instance of the configured eviction policy (each store gets its own: the
        workflow-aware policy keeps state)."""
        from samcache.policies import POLICIES, make_policy

        if self.eviction_policy == "attention":
            raise ValueError("samcache: eviction_policy 'attention' needs the attention samples of samcache's own "
                             "engine; the plugins support 'lru', 'priority-lru' and 'workflow'")
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in POLICIES:
            raise ValueError(f"samcache: unknown eviction_policy {self.eviction_policy!r}; "
                             f"choose from 'lru', 'priority-lru', 'workflow'")
        try:
            return make_policy(self.eviction_policy, **dict(self.eviction_options or {}))
        except ValueError as e:
            raise ValueError(f"samcache: eviction_options: {e}") from None

    def layer_rates(self, num_layers: int) -> tuple[float, ...]:
        """The per-layer recompute rates for a model of ``num_layers`` decoder layers."""
        if self.recompute_rates is None:
            return (self.recompute_ratio,) * num_layers
        if len(self.recompute_rates) != num_layers:
            raise ValueError(f"samcache: recompute_rates has {len(self.recompute_rates)} entries, "
                             f"the model has {num_layers} decoder layers")
        return self.recompute_rates


__all__ = ["ReuseSettings"]
