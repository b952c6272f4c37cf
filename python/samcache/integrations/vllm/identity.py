"""Image identity inside vLLM: every image's vLLM identifier is a samcache content key.

vLLM names each multimodal item by a content hash of its pixels, the model id and the processor
options (blake3 by default; its encoder cache, processor cache and prefix-cache block hashes all
use that name). The plugin's processor marks the names vLLM derived from pixels with ``samcache:``;
a name a client chose (``multi_modal_uuids``) stays unmarked and samcache never reuses that item:
its content cannot be checked. The store's key (:func:`store_key`) is the marked name under
samcache's :class:`~samcache.hashing.Namespace` of the model fingerprint and the request's tenant,
so vLLM's caches and samcache's store agree on one identity, one changed pixel is another image
everywhere, and another model or tenant never hits.
"""

from __future__ import annotations

from typing import Any

from samcache.hashing import ContentHash, ContentKey, Namespace, hash_bytes
from samcache.model_identity import model_fingerprint

PREFIX = "samcache:"


def content_identifier(vllm_hash: str) -> str:
    """The identifier of an image vLLM named ``vllm_hash`` from its pixels."""
    if not isinstance(vllm_hash, str) or not vllm_hash:
        raise ValueError(f"vllm_hash must be a non-empty string, got {vllm_hash!r}")
    return PREFIX + vllm_hash


def content_of(identifier: str) -> ContentHash | None:
    """The content of an image named by ``identifier``; None for identifiers that are not content
    hashes (never reused)."""
    if not isinstance(identifier, str) or not identifier.startswith(PREFIX) or len(identifier) <= len(PREFIX):
        return None
    return hash_bytes(identifier.encode())


def store_key(identifier: str, namespace: Namespace) -> ContentKey | None:
    """The store key of an image identifier under ``namespace`` (by content alone); None for
    identifiers that are not content hashes."""
    content = content_of(identifier)
    return None if content is None else namespace.key(content)


def model_id(vllm_config: Any) -> str:
    """The model part of the store's keys (:func:`samcache.model_identity.model_fingerprint`): the
    checkpoint, its revision, the dtype, the architecture and the KV dtype (KV from another of
    these is never reused)."""
    m = vllm_config.model_config
    archs = ",".join(getattr(m.hf_config, "architectures", None) or [])
    return model_fingerprint(m.model, runtime="vllm", revision=m.revision, dtype=m.dtype, architectures=archs,
                             kv_dtype=vllm_config.cache_config.cache_dtype)


def make_processor_class(base: type) -> type:
    """``base`` (vLLM's multimodal processor of the model) marking the images it named by content."""

    class SamcacheProcessor(base):
        def _get_mm_hashes(self, inputs):
            hashes = super()._get_mm_hashes(inputs)
            if "image" not in hashes:
                return hashes
            uuids = (inputs.mm_uuid_items or {}).get("image") or [None] * len(hashes["image"])
            named = [content_identifier(h) if uuid is None else h for h, uuid in zip(hashes["image"], uuids)]
            return {**hashes, "image": named}

    SamcacheProcessor.__name__ = SamcacheProcessor.__qualname__ = f"Samcache{base.__name__}"
    return SamcacheProcessor
