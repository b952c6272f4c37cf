"""Memory tiers below the device pool (issue 13, in progress): the cold-tier encoding of KV items
(:mod:`samcache.tiers.cold`: FP8/INT8 + zstd, self-describing and checked), the local-disk tier
(:mod:`samcache.tiers.disk`), host memory over it (:mod:`samcache.tiers.lower`), which the
engine's image-KV store demotes to and loads from (:mod:`samcache.tiers.transfer`: layer by
layer), and a store shared by engine instances (:mod:`samcache.tiers.remote`: Mooncake Store or
Redis)."""

from samcache.tiers.cold import MAGIC, QTYPES, VERSION, ColdFormatError, Encoded, ForeignItem, decode, encode, read_header
from samcache.tiers.disk import DiskTier, StoredKV
from samcache.tiers.lower import Fetched, LowerTiers
from samcache.tiers.remote import MooncakeStore, RedisStore, RemoteStore, RemoteStoreError, RemoteTier

__all__ = ["MAGIC", "QTYPES", "VERSION", "ColdFormatError", "DiskTier", "Encoded", "Fetched", "ForeignItem", "LowerTiers", "MooncakeStore", "RedisStore", "RemoteStore", "RemoteStoreError", "RemoteTier", "StoredKV", "decode", "encode", "read_header"]
