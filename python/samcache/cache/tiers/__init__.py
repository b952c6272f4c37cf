"""Memory tiers below the device pool: the cold-tier encoding of KV items
(:mod:`samcache.cache.tiers.cold`: FP8/INT8 + zstd, self-describing and checked), the local-disk tier
(:mod:`samcache.cache.tiers.disk`), host memory over it (:mod:`samcache.cache.tiers.lower`), which the
engine's image-KV store demotes to and loads from (:mod:`samcache.cache.tiers.transfer`: layer by
layer), and a store shared by engine instances (:mod:`samcache.cache.tiers.remote`: Mooncake Store or
Redis)."""

from samcache.cache.tiers.cold import MAGIC, QTYPES, VERSION, ColdFormatError, Encoded, ForeignItem, decode, encode, read_header
from samcache.cache.tiers.disk import DiskTier, StoredKV
from samcache.cache.tiers.lower import Fetched, LowerTiers
from samcache.cache.tiers.remote import MooncakeStore, RedisStore, RemoteStore, RemoteStoreError, RemoteTier

__all__ = ["MAGIC", "QTYPES", "VERSION", "ColdFormatError", "DiskTier", "Encoded", "Fetched", "ForeignItem", "LowerTiers", "MooncakeStore", "RedisStore", "RemoteStore", "RemoteStoreError", "RemoteTier", "StoredKV", "decode", "encode", "read_header"]
