"""The engine's settings, one dataclass per thing they configure, each checked when built.

``SAMcacheEngine`` takes the groups (``cache=CacheConfig(num_blocks=64)``) or their fields as flat
keywords (``SAMcacheEngine(path, recompute_ratio=0.05)``; :data:`KEYWORDS` maps each to its group
and field). A keyword overrides the same field of a group given beside it. Checks that need the
loaded model (a check layer deeper than the model, compression on a dense model, curves of
another depth) stay with the engine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from samcache._checks import check_fraction, check_int
from samcache.compression.settings import DEFAULT_KEEP
from samcache.policies import POLICIES, EvictionPolicy, make_policy
from samcache.profile.image_attention import ImageAttention
from samcache.profile.reuse_profile import ReuseProfile
from samcache.recompute import SensitivityCurves
from samcache.recompute.method import RepairMethod
from samcache.recompute.methods import repair_method
from samcache.recompute.serving import BUDGETS, check_keep_image_order
from samcache.recompute.two_track import TwoTrack
from samcache.cache.tiers import RemoteStore


@dataclass(frozen=True)
class CacheConfig:
    """Which cache levels serve reuse, the paged pool and the stores' bounds, and the space their
    keys live in (``model_id``, default a fingerprint of the checkpoint; ``tenant``).
    ``enabled=False`` turns off all three levels."""

    enabled: bool = True
    prefix_cache: bool = True
    prefix_reuse: str = "exact"
    vit_cache: bool = True
    image_kv_cache: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    vit_cache_bytes: int = 256 << 20
    image_kv_cache_bytes: int | None = None
    model_id: str | None = None
    tenant: str | bytes | None = None

    def __post_init__(self) -> None:
        for name in ("enabled", "prefix_cache", "vit_cache", "image_kv_cache"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{_keyword(self, name)} must be a bool, got {getattr(self, name)!r}")
        if self.prefix_reuse not in ("exact", "approximate"):
            raise ValueError(f"prefix_reuse must be 'exact' or 'approximate', got {self.prefix_reuse!r}")
        for name, optional in (("block_size", False), ("num_blocks", True), ("kv_cache_bytes", True),
                               ("vit_cache_bytes", False), ("image_kv_cache_bytes", True)):
            if getattr(self, name) is not None or not optional:
                check_int(name, getattr(self, name), 1)
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("pass num_blocks or kv_cache_bytes (the pool's size), not both")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id
                                          or "\x00" in self.model_id):
            raise ValueError(f"model_id must be a non-empty str without NUL characters (samcache derives cache "
                             f"spaces from it with them), got {self.model_id!r}")
        if self.tenant is not None and not isinstance(self.tenant, (str, bytes)):
            raise TypeError(f"tenant must be a str, bytes or None, got {type(self.tenant).__name__}")

    @property
    def use_prefix(self) -> bool:
        return self.enabled and self.prefix_cache

    @property
    def use_vit_cache(self) -> bool:
        return self.enabled and self.vit_cache

    @property
    def use_image_kv(self) -> bool:
        return self.enabled and self.image_kv_cache


@dataclass(frozen=True)
class RecomputeConfig:
    """How reused image KV is repaired: the mean share of its tokens recomputed a layer, how that
    share is split across layers, which tokens (the repair method, docs/design.md "Repair
    methods") and where an image's KV may be reused at all (``keep_image_order``). The model's side
    of that: ``image_attention`` (None: what the checkpoint declares; a name or an
    :class:`~samcache.profile.image_attention.ImageAttention` overrides it) and its reuse
    ``profile`` (None: the one in the checkpoint's folder; False: none; a path or a
    :class:`~samcache.profile.reuse_profile.ReuseProfile`)."""

    ratio: float = 0.05
    budget: str = "layer-aware"
    sensitivity: SensitivityCurves | str | os.PathLike | None = None
    method: str | RepairMethod = "two-track"
    head_fraction: float = 0.1
    track2_share: float = 0.5
    tracks: str = "both"
    relevance: str = "attention"
    keep_image_order: bool | str = "auto"
    image_attention: str | ImageAttention | None = None
    profile: str | os.PathLike | ReuseProfile | bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_fraction("recompute_ratio", self.ratio))
        if isinstance(self.image_attention, str):
            object.__setattr__(self, "image_attention", ImageAttention.parse(self.image_attention))
        elif self.image_attention is not None and not isinstance(self.image_attention, ImageAttention):
            raise TypeError(f"image_attention must be a name, an ImageAttention or None, got "
                            f"{type(self.image_attention).__name__}")
        if self.profile is True or not (self.profile is None or self.profile is False
                                        or isinstance(self.profile, (str, os.PathLike, ReuseProfile))):
            raise TypeError(f"profile must be a path, a ReuseProfile, False (none) or None (the checkpoint's), "
                            f"got {self.profile!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"recompute_budget must be 'layer-aware' or 'uniform', got {self.budget!r}")
        if self.relevance not in ("attention", "routing"):
            raise ValueError(f"recompute_relevance must be 'attention' or 'routing', got {self.relevance!r}")
        check_keep_image_order(self.keep_image_order)
        object.__setattr__(self, "_repair", _repair_method(self.method, self.head_fraction, self.track2_share,
                                                           self.tracks))

    @property
    def repair(self) -> RepairMethod:
        """The method object that orders the recomputed tokens."""
        return self._repair


@dataclass(frozen=True)
class CompressionConfig:
    """Visual-token compression (MoE checkpoints): each image a turn computes keeps ``keep`` of its
    tokens, reached in stages at ``layers`` (default: the seed's layers scaled to the model)."""

    enabled: bool = False
    keep: float = DEFAULT_KEEP
    layers: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"compression_enabled must be a bool, got {self.enabled!r}")


@dataclass(frozen=True)
class TierConfig:
    """Tiers below the pool (:mod:`samcache.cache.tiers`): host memory, a disk folder and a shared store
    for image KV; host memory and disk for prefix blocks and ViT outputs. All off by default."""

    host_kv_cache_bytes: int = 0
    disk_kv_cache_dir: str | os.PathLike | None = None
    disk_kv_cache_bytes: int = 4 << 30
    cold_kv_qtype: str | None = "fp8_e4m3"
    remote_kv_store: RemoteStore | None = None
    host_prefix_cache_bytes: int = 0
    disk_vit_cache_bytes: int = 0
    disk_prefix_cache_bytes: int = 0
    host_vit_cache_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("host_kv_cache_bytes", "host_prefix_cache_bytes", "disk_vit_cache_bytes",
                     "disk_prefix_cache_bytes", "host_vit_cache_bytes"):
            check_int(name, getattr(self, name), 0)
        check_int("disk_kv_cache_bytes", self.disk_kv_cache_bytes, 1)
        if self.cold_kv_qtype not in ("fp8_e4m3", "int8", None):
            raise ValueError(f"cold_kv_qtype must be 'fp8_e4m3', 'int8' or None (lossless), got {self.cold_kv_qtype!r}")
        if self.remote_kv_store is not None and not isinstance(self.remote_kv_store, RemoteStore):
            raise TypeError(f"remote_kv_store must be a samcache.cache.tiers.RemoteStore (e.g. MooncakeStore), "
                            f"got {type(self.remote_kv_store).__name__}")
        if (self.disk_vit_cache_bytes or self.disk_prefix_cache_bytes) and self.disk_kv_cache_dir is None:
            raise ValueError("disk_vit_cache_bytes and disk_prefix_cache_bytes need disk_kv_cache_dir (their files go "
                             "in its vit/ and prefix-blocks/ folders)")
        if self.disk_prefix_cache_bytes and not self.host_prefix_cache_bytes:
            raise ValueError("disk_prefix_cache_bytes needs host_prefix_cache_bytes > 0: prefix blocks reach the disk "
                             "when host memory cannot keep them")

    @property
    def holds_image_kv(self) -> bool:
        """Whether any tier below the pool takes image KV."""
        return bool(self.host_kv_cache_bytes or self.disk_kv_cache_dir is not None or self.remote_kv_store is not None)


@dataclass(frozen=True)
class EvictionConfig:
    """What the pool and the stores give up first (a policy name with its options, or a policy
    object), and how many workflow steps ahead the tiers prefetch (with ``"workflow"``)."""

    policy: str | EvictionPolicy = "lru"
    options: dict | None = None
    prefetch_horizon: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.policy, EvictionPolicy):
            if self.options:
                raise ValueError("eviction_options go with a policy name, not with a policy object")
        elif isinstance(self.policy, str):
            if self.options is not None and not isinstance(self.options, dict):
                raise TypeError(f"eviction_options must be a dict, got {type(self.options).__name__}")
            make_policy(self.policy, **(self.options or {}))  # an unknown name or option fails here
        else:
            raise TypeError(f"eviction_policy must be a policy name ({', '.join(POLICIES)}) or an EvictionPolicy, "
                            f"got {type(self.policy).__name__}")
        check_int("prefetch_horizon", self.prefetch_horizon, 0)

    def make_policy(self) -> EvictionPolicy:
        """The policy object (a fresh one per engine where a name was given)."""
        return self.policy if isinstance(self.policy, EvictionPolicy) else make_policy(self.policy, **(self.options or {}))


GROUPS = {"cache": CacheConfig, "recompute": RecomputeConfig, "compression": CompressionConfig,
          "tiers": TierConfig, "eviction": EvictionConfig}

# Flat keyword -> (group, field). The keywords are the engine's documented argument names.
KEYWORDS: dict[str, tuple[str, str]] = {
    "cache_enabled": ("cache", "enabled"),
    **{name: ("cache", name) for name in ("prefix_cache", "prefix_reuse", "vit_cache", "image_kv_cache", "block_size",
                                          "num_blocks", "kv_cache_bytes", "vit_cache_bytes", "image_kv_cache_bytes",
                                          "model_id", "tenant")},
    "recompute_ratio": ("recompute", "ratio"),
    "recompute_budget": ("recompute", "budget"),
    "sensitivity": ("recompute", "sensitivity"),
    "recompute_method": ("recompute", "method"),
    "head_fraction": ("recompute", "head_fraction"),
    "track2_share": ("recompute", "track2_share"),
    "recompute_tracks": ("recompute", "tracks"),
    "recompute_relevance": ("recompute", "relevance"),
    "keep_image_order": ("recompute", "keep_image_order"),
    "image_attention": ("recompute", "image_attention"),
    "profile": ("recompute", "profile"),
    "compression_enabled": ("compression", "enabled"),
    "compression_keep": ("compression", "keep"),
    "compression_layers": ("compression", "layers"),
    **{f.name: ("tiers", f.name) for f in fields(TierConfig)},
    "eviction_policy": ("eviction", "policy"),
    "eviction_options": ("eviction", "options"),
    "prefetch_horizon": ("eviction", "prefetch_horizon"),
}
_NAMES = {(group, name): keyword for keyword, (group, name) in KEYWORDS.items()}


@dataclass(frozen=True)
class EngineConfig:
    """The five groups, complete: what :meth:`resolve` makes of the engine's arguments."""

    cache: CacheConfig
    recompute: RecomputeConfig
    compression: CompressionConfig
    tiers: TierConfig
    eviction: EvictionConfig

    @classmethod
    def resolve(cls, groups: dict[str, Any], keywords: dict[str, Any]) -> "EngineConfig":
        """The groups given (None: defaults) with the flat ``keywords`` set over them. An unknown
        keyword or a group of the wrong type raises ``TypeError`` naming it."""
        unknown = sorted(set(keywords) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"SAMcacheEngine() got an unexpected keyword argument {unknown[0]!r}")
        out = {}
        for group, kind in GROUPS.items():
            given = groups.get(group)
            if given is not None and not isinstance(given, kind):
                raise TypeError(f"{group} must be a samcache.engine.config.{kind.__name__}, got {type(given).__name__}")
            updates = {KEYWORDS[k][1]: v for k, v in keywords.items() if KEYWORDS[k][0] == group}
            out[group] = kind(**updates) if given is None else (replace(given, **updates) if updates else given)
        if out["recompute"].relevance == "routing" and not out["compression"].enabled:
            raise ValueError("recompute_relevance='routing' ranks compressed images' tokens by routing confidence: it "
                             "needs compression_enabled=True")
        return cls(**out)


def _keyword(config: Any, name: str) -> str:
    """The engine keyword of a group's field (what the user wrote)."""
    group = next(g for g, kind in GROUPS.items() if isinstance(config, kind))
    return _NAMES.get((group, name), name)


def _repair_method(method, head_fraction: float, track2_share: float, tracks: str) -> RepairMethod:
    """The engine's repair method: ``method`` (a name or a RepairMethod), with the two-track
    settings where it is two-track; those settings given with another method are an error."""
    if tracks not in ("both", "heads"):
        raise ValueError(f"recompute_tracks must be 'both' or 'heads', got {tracks!r}")
    if isinstance(method, str) and method == TwoTrack.name:
        return TwoTrack(head_fraction=head_fraction, track2_share=track2_share, tracks=tracks)
    method = repair_method(method)
    given = [name for name, value, default in (("head_fraction", head_fraction, 0.1), ("track2_share", track2_share, 0.5),
                                                ("recompute_tracks", tracks, "both")) if value != default]
    if given:
        raise ValueError(f"{', '.join(given)} shape recompute_method='two-track', not {method.name!r} "
                         f"(give the method's own settings as an object, e.g. samcache.recompute.{type(method).__name__}(...))")
    return method
