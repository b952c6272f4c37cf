"""One model fingerprint for the engine and both plugins: the part of every cache key that says
which model computed the KV, so KV of another checkpoint, revision, dtype or architecture is
never reused.

A local checkpoint folder is named by its content (its config and a sample of every weight
file's bytes), so two checkpoints with one config but other weights (another seed, a fine-tune)
differ even under one path; a name the runtime resolves elsewhere (a hub id) by that name and
its revision.
"""

from __future__ import annotations

import os
import pathlib

import xxhash


def weights_digest(path: str | os.PathLike) -> str | None:
    """A digest of a local checkpoint folder: its config.json and 64 chunks of 64 KiB spread over
    each safetensors file (with its name and size); None where ``path`` is not such a folder."""
    path = pathlib.Path(path)
    config = path / "config.json"
    if not config.is_file():
        return None
    h = xxhash.xxh3_64(config.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            for i in range(64):
                fh.seek(size * i // 64)
                h.update(fh.read(65536))
    return h.hexdigest()


def model_fingerprint(checkpoint: str | os.PathLike, *, runtime: str | None = None, **details) -> str:
    """The model id of ``checkpoint`` (a local folder, or for a serving runtime also a name it
    resolves). samcache's own engine (``runtime=None``) needs a local folder and gets
    ``"<folder name>:<weights digest>"``. A runtime (``"vllm"``, ``"sglang"``) gets
    ``"<runtime>|<weights digest, else the name>|key=value..."`` with the ``details`` that change
    the KV it computes (revision, dtype, architecture, KV dtype), in the order given."""
    if not isinstance(checkpoint, (str, os.PathLike)) or not str(checkpoint):
        raise ValueError(f"checkpoint must be a non-empty path or name, got {checkpoint!r}")
    digest = weights_digest(checkpoint)
    if runtime is None:
        if digest is None:
            raise ValueError(f"{checkpoint} is not a checkpoint folder (no config.json)")
        return f"{pathlib.Path(checkpoint).name}:{digest}"
    named = digest if digest is not None else str(checkpoint)
    return "|".join([runtime, named, *(f"{k}={v}" for k, v in details.items())])


__all__ = ["model_fingerprint", "weights_digest"]
