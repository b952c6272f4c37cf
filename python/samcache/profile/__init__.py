"""What an engine must know about a model before it reuses an image's KV: how the model's images
attend (:mod:`samcache.profile.image_attention`, declared by the checkpoint) and its reuse profile
(:mod:`samcache.profile.reuse_profile`, written by ``samcache calibrate``)."""

from samcache.profile.image_attention import CAUSAL, ImageAttention
from samcache.profile.reuse_profile import PROFILE_FILE, ReuseProfile, find_profile, read_profile, write_profile

__all__ = ["CAUSAL", "ImageAttention", "PROFILE_FILE", "ReuseProfile", "find_profile", "read_profile", "write_profile"]
