"""What an engine plugin of samcache is told: how much of a reused image to recompute, how big the
image-KV store is, the default tenant and where to write metrics. The vLLM plugin reads these from
``kv_connector_extra_config``, the SGLang plugin from ``SAMCACHE_SGLANG``; both are checked at
start-up, so a typo or a value out of range stops the server with a message naming the key."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from samcache._checks import check_fraction, check_int
from samcache.recompute.serving import check_keep_image_order, keeps_image_order, load_curves, serving_budget

logger = logging.getLogger("samcache")


@dataclass(frozen=True)
class ReuseSettings:
    """``recompute_ratio``: fraction of a reused image's tokens recomputed at every layer (0: none,
    1: all, i.e. outputs equal the engine's own prefill); ``recompute_rates``: per-layer fractions
    instead (non-increasing with depth, one per decoder layer; overrides the ratio);
    ``recompute_method``: the repair method that orders the recomputed tokens
    (:mod:`samcache.recompute.method`): ``"two-track"`` (default; track 2 in position order: the
    plugins have no relevance scores) or ``"boundary"``; ``"deviation"``, ``"boundary+deviation"``
    and ``"isolated"`` (the repair method) need samcache's own forward and are refused at start-up;
    ``head_fraction``: share of each image's quota spent on its first tokens (two-track's track 1);
    ``sensitivity``: the path of calibrated curves (``engine.calibrate(save=...)`` on samcache's
    engine, same checkpoint): the per-layer rates are then solved from them (layer-aware, as the
    engine does) unless ``recompute_rates`` are given; ``keep_image_order``: an image's KV is reused
    only where it keeps its index among the request's images (True), at any index (False), or as
    the curves' image-order check says for the served rates (``"auto"``, default; without curves
    the order is kept: exact), for a model whose images attend in isolation always at any index
    (exact: nothing is recomputed, :meth:`isolated_serving`);
    ``profile``: the path of the model's reuse profile (``samcache calibrate MODEL``); by default
    the plugin reads ``samcache_profile.json`` from the model's folder (:meth:`reuse_profile`), and
    its curves serve where ``sensitivity`` is not given;
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
    recompute_method: str = "two-track"
    head_fraction: float = 0.1
    sensitivity: str | None = None
    keep_image_order: bool | str = "auto"
    profile: str | None = None
    store_bytes: int = 1 << 30
    tenant: str = "default"
    metrics_path: str | None = None
    eviction_policy: str = "lru"
    eviction_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        # Built directly (not through from_mapping), a bad method would otherwise run as boundary.
        check_fraction("samcache: recompute_ratio", self.recompute_ratio)
        _check_method(self.recompute_method)
        try:
            check_keep_image_order(self.keep_image_order)
        except TypeError as e:
            raise ValueError(f"samcache: {e}") from None

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
        method = extra.get("recompute_method", cls.recompute_method)
        _check_method(method)
        if "head_fraction" in extra and method != "two-track":
            raise ValueError(f"samcache: head_fraction shapes recompute_method 'two-track', not {method!r}")
        store = check_int("samcache: store_bytes", extra.get("store_bytes", cls.store_bytes), 1)
        curves = extra.get("sensitivity")
        if curves is not None and (not isinstance(curves, str) or not curves):
            raise ValueError(f"samcache: sensitivity must be the path of a curves JSON, got {curves!r}")
        keep = extra.get("keep_image_order", cls.keep_image_order)  # checked by __post_init__
        profile = extra.get("profile")
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise ValueError(f"samcache: profile must be the path of a reuse profile, got {profile!r}")
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
        out = cls(recompute_ratio=ratio, recompute_rates=rates, recompute_method=method, head_fraction=head,
                  sensitivity=curves, keep_image_order=keep, profile=profile, store_bytes=store,
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

    def reuse_profile(self, model: str | None, num_layers: int):
        """The model's reuse profile: ``profile`` if given, else the one in checkpoint folder
        ``model`` (None where there is none), checked against the checkpoint."""
        import pathlib

        from samcache.profile.reuse_profile import find_profile, read_profile

        folder = model if model is not None and pathlib.Path(model).is_dir() else None
        try:
            if self.profile is not None:
                return read_profile(self.profile, folder, num_layers=num_layers)
            return find_profile(folder, num_layers=num_layers) if folder is not None else None
        except ValueError as e:
            raise ValueError(f"samcache: {e}") from None

    def isolated_serving(self, model: str | None, profile, frame_token: int | None):
        """How to serve the model's images when they attend in isolation (its checkpoint folder
        ``model`` or its reuse ``profile`` says so): an
        :class:`~samcache.integrations.isolated_rows.IsolatedServing`, else None (causal). The
        plugins serve models isolated at every layer; the top-k variant is refused here, at
        start-up, and so are explicit ``recompute_rates`` (an isolated image's KV is exact anywhere:
        recomputing it in context would make it wrong; ``recompute_ratio`` and curves go unused)."""
        import pathlib

        from samcache.integrations.isolated_rows import IsolatedServing
        from samcache.profile.image_attention import declared

        folder = model if model is not None and pathlib.Path(model).is_dir() else None
        try:
            attention = profile.image_attention if profile is not None else declared(folder) if folder else None
        except ValueError as e:
            raise ValueError(f"samcache: {e}") from None
        if attention is None or not attention.isolated:
            return None
        if self.recompute_rates is not None:
            raise ValueError(f"samcache: {model} declares image attention {attention.name}: a reused image's KV is "
                             "exact at any index and nothing of it is recomputed; drop recompute_rates")
        if frame_token is None:
            raise ValueError(f"samcache: {model} declares image attention {attention.name}, but its config names "
                             "no vision_start_token_id (the frame token its images are computed after)")
        return IsolatedServing(attention, int(frame_token))

    def budget(self, num_layers: int, profile=None):
        """The recompute budget of a model of ``num_layers`` decoder layers: the per-layer rates in
        the order of the configured method (two-track without relevance scores)."""
        from samcache.recompute import Boundary, TwoTrack
        from samcache.reuse import RecomputeBudget

        method = (TwoTrack(head_fraction=self.head_fraction, relevance=False) if self.recompute_method == "two-track"
                  else Boundary())
        return RecomputeBudget(self.layer_rates(num_layers, profile), method)

    def curves(self, num_layers: int, profile=None):
        """The calibrated curves: ``sensitivity``'s, else the reuse ``profile``'s (None without
        either), checked against the model's depth."""
        if self.sensitivity is None:
            return None if profile is None else profile.curves
        try:
            return load_curves(self.sensitivity, num_layers=num_layers)
        except ValueError as e:
            raise ValueError(f"samcache: {e}") from None

    def keeps_image_order(self, num_layers: int, profile=None) -> bool:
        """Whether image KV is keyed by content and index (:func:`samcache.recompute.serving.keeps_image_order`,
        as the engine decides it, at the mean of the served rates)."""
        rates = self.layer_rates(num_layers, profile)
        kind = "uniform" if self.recompute_rates is not None else "layer-aware"
        curves = self.curves(num_layers, profile)
        if self.keep_image_order == "auto" and curves is None:
            logger.info("samcache: keep_image_order='auto' with no reuse profile or curves: an image's KV is reused "
                        "only where the image keeps its index among the request's images (exact); "
                        "`samcache calibrate MODEL` writes the model's profile")
        return keeps_image_order(self.keep_image_order, curves, sum(rates) / len(rates), kind)

    def layer_rates(self, num_layers: int, profile=None) -> tuple[float, ...]:
        """The per-layer recompute rates for a model of ``num_layers`` decoder layers: the given ones,
        else solved from the curves for ``recompute_ratio`` (the same at every layer without them)."""
        if self.recompute_rates is None:
            budget = serving_budget(self.curves(num_layers, profile), self.recompute_ratio, num_layers)
            return tuple(float(r) for r in budget.rates)
        if len(self.recompute_rates) != num_layers:
            raise ValueError(f"samcache: recompute_rates has {len(self.recompute_rates)} entries, "
                             f"the model has {num_layers} decoder layers")
        return self.recompute_rates


#: The repair methods the plugins run: their order needs nothing but the plan.
PLUGIN_METHODS = ("two-track", "boundary")


def _check_method(method: Any) -> None:
    """A clear error for a recompute method the plugins cannot run."""
    if method not in PLUGIN_METHODS:
        from samcache.recompute.methods import registered

        why = ("needs samcache's own forward (key deviation inside the step, or image KV computed alone)"
               if isinstance(method, str) and method in registered() else "is not a recompute method")
        raise ValueError(f"samcache: recompute_method {method!r} {why}; the plugins run "
                         f"{', '.join(repr(m) for m in PLUGIN_METHODS)}")

__all__ = ["PLUGIN_METHODS", "ReuseSettings"]
