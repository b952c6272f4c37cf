"""The cold-tier encoding of a KV item: 8-bit quantized, zstd-compressed, self-describing, checked.

An item is one image's (or prefix's) KV for every layer: a tensor ``[layers, 2, tokens, kv_heads,
head_dim]`` (K then V) in float32, float16 or bfloat16. On its way to disk or a shared store it is
cut into blocks of ``block_size`` tokens and quantized per block or per (block, head) to FP8
(e4m3) or INT8 with the ``quantize_kv_blocks`` kernel (CacheGen-style: 8 bits a value plus one
float32 scale a group), then compressed with zstd. ``qtype=None`` keeps the values as they are
(lossless; compression only).

Layout: ``MAGIC`` (8 bytes) | header length (u32, little endian) | header (UTF-8 JSON) | payload
(one zstd frame: the quantized values then the scales). The header records the format version,
the namespace digest and the content key the item belongs to, shape, dtype, qtype, per_head,
block_size, the payload's length, and an xxh3-128 over the other header fields and the payload. :func:`decode` refuses (``ColdFormatError``)
anything whose magic, version, namespace, key, length or checksum differs, or whose fields do not
describe a consistent tensor: the caller drops the item and recomputes it, never uses it. No
pickle anywhere: JSON and raw little-endian arrays only.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from samcache._checks import check_int
from samcache.hashing import ContentKey, Namespace

MAGIC = b"SAMKV\x00\x01\n"
VERSION = 1
QTYPES = ("fp8_e4m3", "int8")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HEADER_LIMIT = 1 << 16
_local = threading.local()


class ColdFormatError(ValueError):
    """An encoded item that must not be used: damaged, truncated, of another format version, or
    made for another namespace or content key."""


class ForeignItem(ColdFormatError):
    """An intact item made for another namespace (model or tenant) or content key: not this
    caller's to use, and not damaged either (a store does not delete it for that)."""


@dataclass(frozen=True)
class Encoded:
    """``data``: the bytes to store; ``raw_bytes``: the item's size in its own dtype."""

    data: bytes
    raw_bytes: int

    @property
    def ratio(self) -> float:
        """raw_bytes / len(data): how much smaller the stored form is."""
        return self.raw_bytes / len(self.data)


def _codecs() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    # zstd contexts are not thread-safe: one pair per thread.
    if not hasattr(_local, "codecs"):
        _local.codecs = (zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor())
    return _local.codecs


def _checksum(header: dict, payload: bytes) -> str:
    """xxh3-128 of the header's fields (all but the checksum) and the payload: a changed shape or
    dtype is caught like a changed byte of data."""
    fields = {k: v for k, v in header.items() if k not in ("checksum", "_offset")}
    return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True).encode() + payload)


def _check_kv(kv) -> None:
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, tokens, kv_heads, head_dim], got shape {tuple(kv.shape)}")
    if kv.dtype not in _DTYPES.values():
        raise TypeError(f"kv must be float32, float16 or bfloat16, got {kv.dtype}")
    if kv.numel() == 0:
        raise ValueError(f"kv is empty (shape {tuple(kv.shape)})")


def encode(kv: torch.Tensor, namespace: Namespace, key: ContentKey, *, qtype: str | None = "fp8_e4m3",
           per_head: bool = True, block_size: int = 16, meta: dict | None = None) -> Encoded:
    """The stored form of ``kv`` (see the module doc); ``key`` is the item's content key; ``meta``:
    a small JSON-able dict kept in the header (e.g. the item's position and its check record)."""
    from samcache.ops import quantize_kv_blocks

    _check_kv(kv)
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a samcache.Namespace, got {type(namespace).__name__}")
    if not isinstance(key, ContentKey):
        raise TypeError(f"key must be a ContentKey, got {type(key).__name__}")
    if qtype is not None and qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES} or None, got {qtype!r}")
    if not isinstance(per_head, bool):
        raise TypeError(f"per_head must be a bool, got {type(per_head).__name__}")
    check_int("block_size", block_size, 1)
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict or None, got {type(meta).__name__}")
    layers, _, tokens, heads, dim = kv.shape
    dtype_name = str(kv.dtype).removeprefix("torch.")
    x = kv.detach().cpu().contiguous()
    if qtype is None:
        body = x.view(torch.uint8).numpy().tobytes()  # raw little-endian values, bfloat16 included
    else:
        nb = -(-tokens // block_size)
        padded = torch.zeros(layers * 2, nb * block_size, heads, dim, dtype=x.dtype)
        padded[:, :tokens] = x.reshape(layers * 2, tokens, heads, dim)
        blocks = padded.view(layers * 2 * nb, block_size, heads, dim)
        q, scales = quantize_kv_blocks(blocks, torch.arange(blocks.shape[0], dtype=torch.int64), qtype, per_head)
        body = q.view(torch.uint8).numpy().tobytes() + scales.numpy().astype("<f4").tobytes()
    payload = _codecs()[0].compress(body)
    header = {
        "version": VERSION, "namespace": namespace.digest.hex(), "key": key.digest.hex(),
        "shape": [layers, 2, tokens, heads, dim], "dtype": dtype_name, "qtype": qtype, "per_head": per_head,
        "block_size": block_size, "payload_bytes": len(payload), "body_bytes": len(body), "meta": meta or {},
    }
    header["checksum"] = _checksum(header, payload)
    head = json.dumps(header, sort_keys=True).encode()
    if len(head) > _HEADER_LIMIT:
        raise ValueError(f"meta is too large for a cold-tier header ({len(head)} bytes, at most {_HEADER_LIMIT})")
    return Encoded(MAGIC + struct.pack("<I", len(head)) + head + payload, x.numel() * x.element_size())


def _frame(data: bytes, magic: bytes, what: str) -> tuple[Any, int]:
    """The JSON header of ``MAGIC | header length | header | payload`` bytes and where the
    payload starts; ``ColdFormatError`` for a bad magic, a truncated frame or a header that is not
    JSON."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(magic) + 4 or not data.startswith(magic):
        raise ColdFormatError(f"not a samcache {what} (bad magic or truncated)")
    (n,) = struct.unpack_from("<I", data, len(magic))
    start = len(magic) + 4
    if n > _HEADER_LIMIT or start + n > len(data):
        raise ColdFormatError(f"{what} header is truncated or too long")
    try:
        return json.loads(data[start:start + n].decode()), start + n
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ColdFormatError(f"{what} header is not valid JSON: {e}") from None


def read_header(data: bytes) -> dict:
    """The header of an encoded item (checked for magic, version and sane fields), without
    decoding the payload."""
    header, offset = _frame(data, MAGIC, "cold-tier item")
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise ColdFormatError(f"cold-tier item of format version {header.get('version') if isinstance(header, dict) else '?'}, "
                              f"this samcache reads version {VERSION}")
    shape = header.get("shape")
    if (not isinstance(shape, list) or len(shape) != 5 or not all(isinstance(v, int) and v > 0 for v in shape)
            or shape[1] != 2 or header.get("dtype") not in _DTYPES or header.get("qtype") not in (*QTYPES, None)
            or not isinstance(header.get("block_size"), int) or header["block_size"] < 1
            or not isinstance(header.get("payload_bytes"), int) or not isinstance(header.get("body_bytes"), int)
            or not isinstance(header.get("meta"), dict)):
        raise ColdFormatError("cold-tier item header has missing or inconsistent fields")
    header["_offset"] = offset
    return header


def decode(data: bytes, namespace: Namespace, key: ContentKey, *, device: str | torch.device = "cpu") -> torch.Tensor:
    """The KV tensor of an encoded item, in its original dtype and shape; ``ColdFormatError`` if it
    is damaged, truncated, or was made for another namespace or key."""
    from samcache.ops import dequantize_kv_blocks

    header = read_header(data)
    if header.get("namespace") != namespace.digest.hex():
        raise ForeignItem("cold-tier item belongs to another model or tenant (namespace differs)")
    if header.get("key") != key.digest.hex():
        raise ForeignItem("cold-tier item holds another content key")
    payload = bytes(data)[header["_offset"]:]
    if len(payload) != header["payload_bytes"]:
        raise ColdFormatError(f"cold-tier item is truncated: payload {len(payload)} of {header['payload_bytes']} bytes")
    if _checksum(header, payload) != header.get("checksum"):
        raise ColdFormatError("cold-tier item does not match its checksum")
    try:
        body = _codecs()[1].decompress(payload, max_output_size=header["body_bytes"])
    except zstandard.ZstdError as e:
        raise ColdFormatError(f"cold-tier item payload does not decompress: {e}") from None
    layers, _, tokens, heads, dim = header["shape"]
    dtype = _DTYPES[header["dtype"]]
    qtype, bs = header["qtype"], header["block_size"]
    if qtype is None:
        expected = layers * 2 * tokens * heads * dim * torch.finfo(dtype).bits // 8
        if len(body) != expected:
            raise ColdFormatError("cold-tier item body has the wrong size for its shape")
        raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        return raw.view(dtype).reshape(layers, 2, tokens, heads, dim).to(device)
    nb = -(-tokens // bs)
    groups = layers * 2 * nb
    values = groups * bs * heads * dim
    n_scales = groups * heads if header["per_head"] else groups
    if len(body) != values + 4 * n_scales:
        raise ColdFormatError("cold-tier item body has the wrong size for its shape")
    qdtype = torch.float8_e4m3fn if qtype == "fp8_e4m3" else torch.int8
    q = torch.frombuffer(bytearray(body[:values]), dtype=torch.uint8).view(qdtype).reshape(groups, bs, heads, dim)
    scales = torch.from_numpy(np.frombuffer(body[values:], dtype="<f4").astype(np.float32))
    if header["per_head"]:
        scales = scales.reshape(groups, heads)
    out = torch.empty(groups, bs, heads, dim, dtype=dtype)
    dequantize_kv_blocks(q, scales, out, torch.arange(groups, dtype=torch.int64))
    kv = out.view(layers * 2, nb * bs, heads, dim)[:, :tokens].reshape(layers, 2, tokens, heads, dim)
    return kv.contiguous().to(device)


# ---- plain tensors (ViT outputs): lossless, the same framing and checks ------------------------
TENSORS_MAGIC = b"SAMTS\x00\x01\n"


def encode_tensors(tensors: list[torch.Tensor], namespace: Namespace, key: ContentKey, *,
                   meta: dict | None = None) -> bytes:
    """The stored form of a few tensors of one item (e.g. an image's ViT output and its DeepStack
    features): raw little-endian values, zstd, a JSON header with their shapes and dtypes, the
    namespace and key, ``meta``, and an xxh3-128 over header and payload."""
    if not isinstance(namespace, Namespace) or not isinstance(key, ContentKey):
        raise TypeError("namespace must be a samcache.Namespace and key a ContentKey")
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dtype in _DTYPES.values() for t in tensors):
        raise TypeError("tensors must be a non-empty list of float32, float16 or bfloat16 tensors")
    parts = [t.detach().cpu().contiguous() for t in tensors]
    body = b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts)
    payload = _codecs()[0].compress(body)
    header = {"version": VERSION, "namespace": namespace.digest.hex(), "key": key.digest.hex(),
              "shapes": [list(p.shape) for p in parts], "dtypes": [str(p.dtype).removeprefix("torch.") for p in parts],
              "payload_bytes": len(payload), "body_bytes": len(body), "meta": meta or {}}
    header["checksum"] = _checksum(header, payload)
    head = json.dumps(header, sort_keys=True).encode()
    if len(head) > _HEADER_LIMIT:
        raise ValueError(f"the header is too large ({len(head)} bytes, at most {_HEADER_LIMIT})")
    return TENSORS_MAGIC + struct.pack("<I", len(head)) + head + payload


def decode_tensors(data: bytes, namespace: Namespace, key: ContentKey) -> tuple[list[torch.Tensor], dict]:
    """The tensors and meta of :func:`encode_tensors`' bytes; ``ColdFormatError`` if damaged or
    truncated, ``ForeignItem`` if made for another namespace or key."""
    header, offset = _frame(data, TENSORS_MAGIC, "tensor item")
    shapes, dtypes = header.get("shapes") if isinstance(header, dict) else None, header.get("dtypes") if isinstance(header, dict) else None
    if (not isinstance(header, dict) or header.get("version") != VERSION or not isinstance(shapes, list)
            or not isinstance(dtypes, list) or len(shapes) != len(dtypes) or not shapes
            or not all(d in _DTYPES for d in dtypes)
            or not all(isinstance(s, list) and all(isinstance(v, int) and v >= 0 for v in s) for s in shapes)
            or not isinstance(header.get("meta"), dict) or not isinstance(header.get("body_bytes"), int)):
        raise ColdFormatError("tensor item header has missing or inconsistent fields")
    if header.get("namespace") != namespace.digest.hex() or header.get("key") != key.digest.hex():
        raise ForeignItem("tensor item belongs to another namespace or content key")
    payload = bytes(data)[offset:]
    if len(payload) != header.get("payload_bytes") or _checksum(header, payload) != header.get("checksum"):
        raise ColdFormatError("tensor item is truncated or does not match its checksum")
    try:
        body = _codecs()[1].decompress(payload, max_output_size=header["body_bytes"])
    except zstandard.ZstdError as e:
        raise ColdFormatError(f"tensor item payload does not decompress: {e}") from None
    sizes = [int(np.prod(s, dtype=np.int64)) * torch.finfo(_DTYPES[d]).bits // 8 for s, d in zip(shapes, dtypes)]
    if sum(sizes) != len(body):
        raise ColdFormatError("tensor item body has the wrong size for its shapes")
    raw = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
    out, at = [], 0
    for s, d, size in zip(shapes, dtypes, sizes):
        out.append(raw[at:at + size].view(_DTYPES[d]).reshape(s).clone())
        at += size
    return out, header["meta"]


__all__ = ["MAGIC", "QTYPES", "TENSORS_MAGIC", "VERSION", "ColdFormatError", "Encoded", "ForeignItem", "decode",
           "decode_tensors", "encode", "encode_tensors", "read_header"]
