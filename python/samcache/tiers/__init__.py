"""Memory tiers below the device pool (issue 13, in progress): the cold-tier encoding of KV items
(:mod:`samcache.tiers.cold`: FP8/INT8 + zstd, self-describing and checked) and the local-disk tier
(:mod:`samcache.tiers.disk`)."""

from samcache.tiers.cold import MAGIC, QTYPES, VERSION, ColdFormatError, Encoded, ForeignItem, decode, encode, read_header
from samcache.tiers.disk import DiskTier

__all__ = ["MAGIC", "QTYPES", "VERSION", "ColdFormatError", "DiskTier", "Encoded", "ForeignItem", "decode", "encode", "read_header"]
