"""samcache: a memory system that makes multimodal agents fast.

Every image an agent re-sends is recognised by content and its vision-encoder output and KV
are reused wherever it appears again. This package holds the Python layer; the native core
is ``samcache._C`` (C++/CUDA) and the kernels are ``torch.ops.samcache.*``.
"""

import torch  # noqa: F401  # loads libtorch before _C, which links against it

from samcache import _C  # noqa: E402
from samcache import ops  # noqa: E402  (registers the fake implementations)
from samcache.cache.block_pool import AppendResult, BlockPool  # noqa: E402
from samcache.cache.content_index import ContentEntry, ContentIndex, Evicted, PutResult, Tier  # noqa: E402
from samcache.errors import (  # noqa: E402
    CacheFull, ImageLoadError, InvariantViolation, NotFound, OutOfBlocks, PromptTooLong, UnsupportedModel,
)
from samcache.hashing import ContentHash, ContentKey, Namespace, decode_image_file, hash_bytes, hash_image  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):  # the engine imports transformers: load it only when asked for
    if name == "SAMcacheEngine":
        from samcache.engine import SAMcacheEngine

        return SAMcacheEngine
    raise AttributeError(f"module 'samcache' has no attribute {name!r}")

__all__ = [
    "AppendResult",
    "BlockPool",
    "CacheFull",
    "ContentEntry",
    "ContentHash",
    "ContentIndex",
    "ContentKey",
    "Evicted",
    "ImageLoadError",
    "InvariantViolation",
    "Namespace",
    "NotFound",
    "OutOfBlocks",
    "PromptTooLong",
    "PutResult",
    "SAMcacheEngine",
    "Tier",
    "UnsupportedModel",
    "decode_image_file",
    "hash_bytes",
    "hash_image",
    "ops",
]
