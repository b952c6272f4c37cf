"""What samcache keeps between turns: ViT outputs (a byte-bounded tensor store) and image KV
(held once, in the pool's own blocks)."""

from samcache.cache.stores.image_kv import HeldImage, ImageKVStore
from samcache.cache.stores.tensor_store import StoreStats, TensorStore, tensor_bytes

__all__ = ["HeldImage", "ImageKVStore", "StoreStats", "TensorStore", "tensor_bytes"]
