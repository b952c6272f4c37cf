"""Memory tiers below the device pool (issue 13, in progress): the cold-tier encoding of KV items
(:mod:`samcache.tiers.cold`: FP8/INT8 + zstd, self-describing and checked) the local-disk tier
(:mod:`samcache.tiers.disk`) and host memory over it (:mod:`samcache.tiers.lower`), which the
engine's image-KV store demotes to and promotes from."""

from samcache.tiers.cold import MAGIC, QTYPES, VERSION, ColdFormatError, Encoded, ForeignItem, decode, encode, read_header
from samcache.tiers.disk import DiskTier, StoredKV
from samcache.tiers.lower import Fetched, LowerTiers
from samcache.tiers.remote import MooncakeStore, RemoteStore, RemoteStoreError, RemoteTier

__all__ = ["MAGIC", "QTYPES", "VERSION", "ColdFormatError", "DiskTier", "Encoded", "Fetched", "ForeignItem", "LowerTiers", "MooncakeStore", "RemoteStore", "RemoteStoreError", "RemoteTier", "StoredKV", "decode", "encode", "read_header"]
