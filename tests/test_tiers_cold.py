"""The cold-tier encoding and the disk tier: round trips on random shapes against a float64
reference bound, every kind of damage refused, files private, LRU by bytes, restarts."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from samcache.hashing import Namespace, hash_bytes
from samcache.cache.tiers import MAGIC, ColdFormatError, DiskTier, ForeignItem, decode, encode, read_header

NS = Namespace("tiny-model", tenant="acme")
KEY = NS.key(hash_bytes(b"image one"))
QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}


def kv_tensor(layers=2, tokens=21, heads=2, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, 2, tokens, heads, dim, generator=g, dtype=torch.float64) * 3).to(dtype)


def reference_bound(kv: torch.Tensor, qtype: str, per_head: bool, block_size: int) -> torch.Tensor:
    """Per value, the largest error round-to-nearest 8-bit quantization may make (float64)."""
    x = kv.double()
    layers, _, tokens, heads, dim = x.shape
    nb = -(-tokens // block_size)
    padded = torch.zeros(layers * 2, nb * block_size, heads, dim, dtype=torch.float64)
    padded[:, :tokens] = x.reshape(layers * 2, tokens, heads, dim)
    blocks = padded.view(layers * 2, nb, block_size, heads, dim)
    dims = (2, 4) if per_head else (2, 3, 4)
    scale = blocks.abs().amax(dim=dims, keepdim=True) / QMAX[qtype]
    if qtype == "int8":
        bound = (scale / 2).expand_as(blocks)
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormal spacing 2^-9 of the scale
        bound = torch.maximum(blocks.abs() * 2.0**-4, (scale * 2.0**-9).expand_as(blocks))
    bound = bound.reshape(layers * 2, nb * block_size, heads, dim)[:, :tokens]
    return bound.reshape(x.shape) * (1 + 1e-3) + 1e-6 * scale.max()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 3), tokens=st.integers(1, 40), heads=st.integers(1, 4), dim=st.sampled_from([4, 8, 16]),
       block_size=st.sampled_from([4, 16]), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       qtype=st.sampled_from(["fp8_e4m3", "int8", None]), per_head=st.booleans(), seed=st.integers(0, 1000))
def test_round_trip_within_the_quantization_bound(layers, tokens, heads, dim, block_size, dtype, qtype, per_head, seed):
    kv = kv_tensor(layers, tokens, heads, dim, dtype, seed)
    enc = encode(kv, NS, KEY, qtype=qtype, per_head=per_head, block_size=block_size)
    out = decode(enc.data, NS, KEY)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    if qtype is None:
        assert torch.equal(out, kv)  # lossless
        return
    # The stored values are those of the kernel in the cache's dtype; the bound is on the
    # float64 originals plus the dtype's own rounding of the restored value.
    err = (out.double() - kv.double()).abs()
    dtype_ulp = kv.double().abs() * torch.finfo(dtype).eps * 2
    assert bool((err <= reference_bound(kv, qtype, per_head, block_size) + dtype_ulp).all())


def test_8bit_is_at_least_3_5_times_smaller_than_float32_and_1_6_than_float16():
    kv = kv_tensor(layers=4, tokens=256, heads=2, dim=64)
    fp8 = encode(kv, NS, KEY, qtype="fp8_e4m3")
    assert fp8.ratio > 3.5  # 4 bytes a value to 1, plus scales; zstd takes a little more off
    half = encode(kv.half(), NS, KEY, qtype="int8")
    assert half.ratio > 1.6
    assert read_header(fp8.data)["shape"] == [4, 2, 256, 2, 64]


def test_every_kind_of_damage_is_refused():
    data = encode(kv_tensor(), NS, KEY).data
    with pytest.raises(ForeignItem, match="namespace"):
        decode(data, Namespace("tiny-model", tenant="other"), KEY)
    with pytest.raises(ForeignItem, match="namespace"):
        decode(data, Namespace("another-model", tenant="acme"), KEY)
    with pytest.raises(ForeignItem, match="content key"):
        decode(data, NS, NS.key(hash_bytes(b"image two")))
    flipped = bytearray(data)
    flipped[-10] ^= 0x01
    with pytest.raises(ColdFormatError, match="checksum"):
        decode(bytes(flipped), NS, KEY)
    with pytest.raises(ColdFormatError, match="truncated"):
        decode(data[:-1], NS, KEY)
    with pytest.raises(ColdFormatError, match="magic"):
        decode(b"PK\x03\x04" + data[4:], NS, KEY)
    with pytest.raises(ColdFormatError, match="truncated"):
        decode(data[:len(MAGIC) + 10], NS, KEY)
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    header = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    for change, match in (({"version": 99}, "version"), ({"shape": [2, 3, 21, 2, 8]}, "inconsistent"),
                          ({"dtype": "float64"}, "inconsistent"), ({"shape": [2, 2, 22, 2, 8]}, "checksum"),
                          ({"per_head": False}, "checksum")):
        head = json.dumps({**header, **change}).encode()
        forged = MAGIC + struct.pack("<I", len(head)) + head + data[len(MAGIC) + 4 + n:]
        with pytest.raises(ColdFormatError, match=match):
            decode(forged, NS, KEY)
    with pytest.raises(TypeError, match="bytes"):
        decode("not bytes", NS, KEY)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="layers, 2, tokens"):
        encode(torch.zeros(2, 3, 4, 1, 4), NS, KEY)
    with pytest.raises(TypeError, match="float32"):
        encode(torch.zeros(1, 2, 4, 1, 4, dtype=torch.float64), NS, KEY)
    with pytest.raises(ValueError, match="qtype"):
        encode(kv_tensor(), NS, KEY, qtype="int4")
    with pytest.raises(TypeError, match="ContentKey"):
        encode(kv_tensor(), NS, b"key")
    with pytest.raises(ValueError, match="block_size"):
        encode(kv_tensor(), NS, KEY, block_size=0)


def test_disk_tier_refuses_bad_options_at_once(tmp_path):
    with pytest.raises(ValueError, match="qtype"):
        DiskTier(tmp_path, 1 << 20, qtype="int4")
    with pytest.raises(ValueError, match="max_bytes"):
        DiskTier(tmp_path, 0)
    with pytest.raises(ValueError, match="block_size"):
        DiskTier(tmp_path, 1 << 20, block_size=0)


# ---- the disk tier --------------------------------------------------------------------------------
def key(i: int):
    return NS.key(hash_bytes(f"image {i}".encode()))


def test_disk_tier_round_trip_private_files_and_lru_by_bytes(tmp_path):
    tier = DiskTier(tmp_path / "cold", max_bytes=1 << 20, qtype="int8")
    kv = kv_tensor(tokens=64)
    assert tier.put(NS, key(0), kv)
    assert stat.S_IMODE(os.stat(tmp_path / "cold").st_mode) == 0o700
    files = list((tmp_path / "cold").iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert tier.put(NS, key(5), kv, {"position": 7, "check": [[1, 4, 6], 6, 2]})
    got = tier.get(NS, key(5))
    assert got.meta == {"position": 7, "check": [[1, 4, 6], 6, 2]}
    out = tier.get(NS, key(0)).kv
    assert out.shape == kv.shape and (out - kv).abs().max() < 0.1
    tier.remove(key(5))
    size = tier.used_bytes
    small = DiskTier(tmp_path / "small", max_bytes=3 * size, qtype="int8")
    for i in range(3):
        small.put(NS, key(i), kv_tensor(tokens=64, seed=i))
    assert small.get(NS, key(0)) is not None  # 0 is now the most recent
    small.put(NS, key(3), kv_tensor(tokens=64, seed=3))
    assert key(1) not in small and key(0) in small and len(small) == 3
    assert small.stats()["evictions"] == 1
    assert small.get(NS, key(1)) is None


def test_disk_tier_drops_damaged_files_and_keeps_foreign_ones(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    tier.put(NS, key(0), kv_tensor())
    tier.put(NS, key(1), kv_tensor(seed=1))
    path = next(p for p in tmp_path.iterdir() if p.name.startswith(key(0).digest.hex()))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert tier.get(NS, key(0)) is None and not path.exists()
    assert tier.stats()["dropped"] == 1
    with pytest.warns(RuntimeWarning, match="another model or tenant"):
        assert tier.get(Namespace("tiny-model", tenant="other"), key(1)) is None  # someone else's: kept
    assert key(1) in tier and tier.get(NS, key(1)) is not None


def test_disk_tier_faults_on_disk_fall_back_with_a_warning_and_a_counter(tmp_path, monkeypatch):
    """Each fault the issue names, made to the files themselves: a truncated file, a file of
    another format version, files swapped between namespaces, a file removed behind the tier.
    Each read is a miss (the caller recomputes), never someone else's or a damaged KV."""
    from samcache.cache.tiers import cold

    tier = DiskTier(tmp_path, max_bytes=1 << 22)
    other = Namespace("tiny-model", tenant="globex")
    ka, kb = NS.key(hash_bytes(b"page a")), other.key(hash_bytes(b"page b"))

    def file_of(k):
        return tmp_path / (k.digest.hex() + ".samkv")

    # Truncated: dropped and deleted.
    assert tier.put(NS, ka, kv_tensor())
    file_of(ka).write_bytes(file_of(ka).read_bytes()[:-40])
    with pytest.warns(RuntimeWarning, match="damaged, truncated"):
        assert tier.get(NS, ka) is None
    assert not file_of(ka).exists() and tier.stats()["dropped"] == 1
    # Another format version (written by a newer samcache): dropped.
    with monkeypatch.context() as m:
        m.setattr(cold, "VERSION", cold.VERSION + 1)
        assert tier.put(NS, ka, kv_tensor())
    with pytest.warns(RuntimeWarning, match="format version"):
        assert tier.get(NS, ka) is None
    assert tier.stats()["dropped"] == 2 and ka not in tier
    # Swapped between namespaces: tenant globex's file under acme's name is never served to acme.
    assert tier.put(NS, ka, kv_tensor(seed=1)) and tier.put(other, kb, kv_tensor(seed=2))
    a, b = file_of(ka).read_bytes(), file_of(kb).read_bytes()
    file_of(ka).write_bytes(b)
    file_of(kb).write_bytes(a)
    with pytest.warns(RuntimeWarning, match="another model or tenant"):
        assert tier.get(NS, ka) is None
    with pytest.warns(RuntimeWarning, match="another model or tenant"):
        assert tier.get(other, kb) is None
    assert tier.stats()["foreign"] == 2
    # Removed behind the tier: a miss with a warning, and the tier forgets it.
    assert tier.put(NS, ka, kv_tensor(seed=3))
    file_of(ka).unlink()
    with pytest.warns(RuntimeWarning, match="removed behind the tier"):
        assert tier.get(NS, ka) is None
    assert tier.stats()["lost"] == 1 and ka not in tier
    # A key never written is a plain miss: no warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tier.get(NS, NS.key(hash_bytes(b"never"))) is None
    assert tier.stats()["misses"] == 1


def test_disk_tier_survives_a_restart_in_recency_order(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        tier.put(NS, key(i), kv_tensor(seed=i))
        os.utime(tmp_path / (key(i).digest.hex() + ".samkv"), ns=(10**18 + i, 10**18 + i))
    (tmp_path / "half-written.samkv.1.2.tmp").write_bytes(b"partial")
    newest_two = sum((tmp_path / (key(i).digest.hex() + ".samkv")).stat().st_size for i in (1, 2))
    again = DiskTier(tmp_path, max_bytes=newest_two)  # smaller bound: the oldest file goes
    assert key(0) not in again and key(1) in again and key(2) in again
    assert not list(tmp_path.glob("*.tmp"))
    assert torch.equal(again.get(NS, key(2)).kv, tier.get(NS, key(2)).kv)
    assert again.put(NS, key(9), kv_tensor(tokens=4000)) is False  # larger than the whole tier
    assert again.stats()["rejected"] == 1


def test_tensor_items_round_trip_and_refuse_damage():
    from samcache.cache.tiers.cold import decode_tensors, encode_tensors

    ns, key = Namespace("m", "t"), Namespace("m", "t").key(hash_bytes(b"vit"))
    tensors = [torch.randn(12, 8), torch.randn(12, 8).to(torch.bfloat16), torch.zeros(0, 8)]
    data = encode_tensors(tensors, ns, key, meta={"check": [1, 2, 4]})
    got, meta = decode_tensors(data, ns, key)
    assert meta == {"check": [1, 2, 4]} and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, tensors))
    with pytest.raises(ForeignItem):
        decode_tensors(data, Namespace("m", "u"), key)
    for bad in (data[:-3], data[:-1] + bytes([data[-1] ^ 1]), b"SAMTS" + data[5:12], b"junk"):
        with pytest.raises(ColdFormatError):
            decode_tensors(bad, ns, key)
    with pytest.raises(TypeError):
        encode_tensors([torch.zeros(3, dtype=torch.int64)], ns, key)
