"""A model's reuse profile: what every engine needs to know before it reuses an image's KV.

``samcache calibrate MODEL`` writes it (:data:`PROFILE_FILE` in the model's folder, or a given
path); samcache's engine and both plugins read it by themselves when they load the model. It holds:

- ``fingerprint``: the checkpoint it was made for (:func:`samcache.model_identity.weights_digest`,
  the same for every runtime); a profile of another checkpoint is refused, naming both;
- ``image_attention``: how the model's images attend (it must match what the checkpoint declares);
- ``curves``: the calibrated per-layer sensitivity curves, with the image-order check;
- ``keep_order``: the order decision at each probe ratio (True: reuse an image's KV only at its
  own index among the prompt's images), as :func:`decide_image_order` takes it.

With no profile and no calibration, every engine keeps the image order: exact, never silently
approximate. The file is written to a temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from dataclasses import dataclass, field
from typing import Any

from samcache.model_identity import weights_digest
from samcache.profile.image_attention import CAUSAL, ImageAttention, declared
from samcache.recompute.budget import SensitivityCurves
from samcache.recompute.serving import keeps_image_order

#: The profile's file name in a model's folder.
PROFILE_FILE = "samcache_profile.json"
FORMAT = "samcache-reuse-profile/1"


@dataclass(frozen=True)
class ReuseProfile:
    fingerprint: str
    image_attention: ImageAttention = CAUSAL
    curves: SensitivityCurves | None = None
    keep_order: dict[float, bool] = field(default_factory=dict)

    def keeps_order(self, ratio: float, uniform: bool = False) -> bool:
        """The order decision at ``ratio`` (:func:`samcache.recompute.serving.keeps_image_order`
        with ``"auto"``): never for isolated image attention, else what the curves' image-order
        check found, and keep the order without one."""
        return keeps_image_order("auto", self.curves, ratio, "uniform" if uniform else "layer-aware",
                                 isolated=self.image_attention.isolated)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "fingerprint": self.fingerprint, "image_attention": self.image_attention.to_dict(),
                "keep_order": {str(r): k for r, k in sorted(self.keep_order.items())},
                "curves": None if self.curves is None else self.curves.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "ReuseProfile":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where} is not a samcache reuse profile (no format {FORMAT!r}; "
                             "write one with `samcache calibrate MODEL`)")
        fingerprint = data.get("fingerprint")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"{where}: fingerprint must be a non-empty string, got {fingerprint!r}")
        attention = ImageAttention.from_dict(data.get("image_attention"), f"{where} [image_attention]")
        try:
            curves = None if data.get("curves") is None else SensitivityCurves.from_dict(data["curves"])
            keep = {float(r): bool(k) for r, k in (data.get("keep_order") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: bad curves or keep_order ({e})") from None
        return cls(fingerprint, attention, curves, keep)


def profile_path(model: str | os.PathLike) -> pathlib.Path:
    """Where a model folder's profile lives."""
    return pathlib.Path(model) / PROFILE_FILE


def make_profile(model: str | os.PathLike, curves: SensitivityCurves | None,
                 image_attention: ImageAttention | None = None) -> ReuseProfile:
    """The profile of checkpoint folder ``model`` with these curves (None: an isolated model needs
    none); the order decision is taken at each of the curves' probe rates."""
    digest = weights_digest(model)
    if digest is None:
        raise ValueError(f"{model} is not a checkpoint folder (no config.json): a profile names its checkpoint")
    attention = declared(model) if image_attention is None else image_attention
    profile = ReuseProfile(digest, attention, curves)
    rates = [] if curves is None else [float(r) for r in curves.rates]
    return ReuseProfile(digest, attention, curves, {r: profile.keeps_order(r) for r in rates})


def write_profile(profile: ReuseProfile, path: str | os.PathLike) -> pathlib.Path:
    """Write ``profile`` to ``path`` (a folder: its :data:`PROFILE_FILE`) atomically."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / PROFILE_FILE
    fd, tmp = tempfile.mkstemp(prefix=".samcache_profile.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # readable as any file written here (mkstemp makes it private)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(profile.to_dict(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_profile(path: str | os.PathLike, model: str | os.PathLike | None = None, *,
                 num_layers: int | None = None) -> ReuseProfile:
    """The profile at ``path`` (a file, or a folder holding :data:`PROFILE_FILE`), checked against
    checkpoint folder ``model`` (its fingerprint and declared image attention) and its depth. A
    clear ValueError naming the file otherwise."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / PROFILE_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"reuse profile {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"reuse profile {path} is not JSON ({e})") from None
    profile = ReuseProfile.from_dict(data, f"reuse profile {path}")
    if model is not None:
        digest = weights_digest(model)
        if digest is not None and digest != profile.fingerprint:
            raise ValueError(f"reuse profile {path} was made for checkpoint {profile.fingerprint}, but {model} is "
                             f"{digest}: calibrate this checkpoint (`samcache calibrate {model}`)")
        attention = declared(model)
        if attention != profile.image_attention:
            raise ValueError(f"reuse profile {path} says image attention {profile.image_attention.name}, but "
                             f"{model}/config.json declares {attention.name}")
    if num_layers is not None and profile.curves is not None and profile.curves.num_layers != num_layers:
        raise ValueError(f"reuse profile {path}: its curves have {profile.curves.num_layers} layers, the model has "
                         f"{num_layers}")
    return profile


def find_profile(model: str | os.PathLike, *, num_layers: int | None = None) -> ReuseProfile | None:
    """The profile in checkpoint folder ``model``, checked (None where it has none)."""
    path = profile_path(model)
    return read_profile(path, model, num_layers=num_layers) if path.is_file() else None


__all__ = ["FORMAT", "PROFILE_FILE", "ReuseProfile", "find_profile", "make_profile",
           "profile_path", "read_profile", "write_profile"]
