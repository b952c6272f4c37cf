"""A short walkthrough of samcache's native core, as an agent engine would drive it.

Run with ``python -m samcache.core_demo``.
It keeps a tiny paged KV cache (2 layers x K/V) in torch tensors and shows, step by step:
prefix reuse across turns keyed by image content, branch forks that share blocks, the
copy-on-write copy a branch needs before it writes, tenant isolation, and the byte-bounded
content index that holds per-image payloads (e.g. vision-encoder outputs).
"""

from __future__ import annotations

import numpy as np
import torch

import samcache
from samcache import BlockPool, ContentIndex, Namespace

BLOCK = 16
IMAGE_PAD = 151655  # Qwen's <|image_pad|>: every image token has this id, so content must be keyed


def _screenshot(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (72, 128, 3), dtype=np.uint8)


def _prompt(system: list[int], image_tokens: int, question: list[int]) -> tuple[np.ndarray, tuple[int, int]]:
    tokens = system + [IMAGE_PAD] * image_tokens + question
    return np.array(tokens, dtype=np.int32), (len(system), len(system) + image_tokens)


def _say(step: str, text: str) -> None:
    print(f"\n[{step}] {text}")


def main() -> None:
    torch.manual_seed(0)
    pool = BlockPool(num_blocks=64, block_size=BLOCK)
    # One paged cache per layer and K/V: [num_blocks, block_size, kv_heads, head_dim].
    caches = [torch.zeros(64, BLOCK, 2, 8) for _ in range(4)]
    ns = Namespace("tiny-qwen2.5-vl", tenant="alice")

    def write_kv(slots: np.ndarray, copies: np.ndarray, value: float) -> None:
        samcache.ops.copy_blocks(caches, copies)  # copy-on-write first, then the new tokens
        idx = torch.from_numpy(slots).long()
        for c in caches:
            c.view(-1, 2, 8)[idx] = value

    print("samcache demo: the native core driven like an agent engine")
    print(f"pool: {pool.num_blocks} blocks x {pool.block_size} tokens; 4 paged caches (2 layers x K/V)")

    shot = _screenshot(1)
    img = samcache.hash_image(shot, preprocess={"max_pixels": 1003520})
    system = list(range(1, 41))
    tokens, (img_lo, img_hi) = _prompt(system, 64, [900, 901, 902, 903, 904])
    keys = [(img_lo, img_hi, img)]

    _say("turn 1", f"prompt of {len(tokens)} tokens: 40 system + 64 image tokens (image {img.hex()[:12]}…) + 5 question")
    turn1 = pool.new_sequence(ns)
    res = pool.append_tokens(turn1, tokens, keys)
    write_kv(res.slots, res.copies, 1.0)
    print(f"  prefilled all {len(tokens)} tokens into blocks {pool.block_table(turn1).tolist()}")
    print(f"  full blocks are hashed (parent hash + token ids + image hash) into the prefix cache: "
          f"{pool.stats()['cached_blocks']} cached")

    _say("fork", "the planner forks two sub-agents over the same context")
    a, b = pool.fork(turn1), pool.fork(turn1)
    last = int(pool.block_table(turn1)[-1])
    print(f"  3 sequences now share {len(pool.block_table(turn1))} blocks; refcount of the last block = "
          f"{pool.refcount(last)}; nothing was copied")

    _say("branch write", "sub-agent B writes its first token into the shared, partly full last block")
    res = pool.append_tokens(b, [1000])
    write_kv(res.slots, res.copies, 2.0)
    (src, dst), = res.copies.tolist()
    print(f"  copy-on-write: block {src} -> block {dst} (performed by torch.ops.samcache.copy_blocks), "
          f"then B wrote slot {int(res.slots[0])}")
    parent_last = caches[0][src].view(-1, 16)[: len(tokens) % BLOCK]
    print(f"  turn-1 context still reads only its own KV: {bool(parent_last.eq(1.0).all())}; "
          f"B's block holds the copy plus its token: {bool(caches[0][dst][len(tokens) % BLOCK].eq(2.0).all())}")

    for s in (turn1, a, b):
        pool.free_sequence(s)
    _say("turn 2", "all sequences freed; the agent re-sends the same system prompt and screenshot")
    print(f"  freed blocks keep their cached content until evicted: {pool.stats()['evictable_blocks']} evictable")
    turn2 = pool.new_sequence(ns)
    reused = pool.adopt_prefix(turn2, tokens, keys)
    rest = pool.append_tokens(turn2, tokens[reused:], keys)
    write_kv(rest.slots, rest.copies, 3.0)
    print(f"  adopt_prefix reused {reused} of {len(tokens)} tokens ({reused // BLOCK} blocks); prefilled only "
          f"{len(tokens) - reused}")

    _say("another image", "same tokens, but a different screenshot behind the <|image_pad|> placeholders")
    other = samcache.hash_image(_screenshot(2), preprocess={"max_pixels": 1003520})
    hit = pool.match_prefix(tokens, [(img_lo, img_hi, other)], namespace=ns)
    print(f"  reusable blocks: {len(hit)} (the {img_lo // BLOCK} full blocks of system tokens before the image; "
          f"every block that overlaps the image misses)")
    hit = pool.match_prefix(tokens, keys, namespace=Namespace("tiny-qwen2.5-vl", tenant="bob"))
    print(f"  the same screenshot for tenant bob: {len(hit)} blocks reusable (tenants never share)")
    pool.free_sequence(turn2)

    _say("content index", "per-image payloads (e.g. ViT outputs) in a byte-bounded index")
    index = ContentIndex(capacity_bytes=3 * 1_000_000)
    vit_bytes = 1_000_000
    for i in range(3):
        index.put(ns.key(samcache.hash_image(_screenshot(10 + i))), handle=i, size_bytes=vit_bytes)
    index.pin(ns.key(samcache.hash_image(_screenshot(10))))  # in use by a running request
    res = index.put(ns.key(samcache.hash_image(_screenshot(13))), handle=3, size_bytes=vit_bytes)
    print(f"  inserting a 4th 1 MB entry into a 3 MB index evicted handle(s) "
          f"{[e.entry.handle for e in res.evicted]} (least recently used; handle 0 is pinned)")
    print(f"  lookup of screenshot 10 for alice: handle {index.get(ns.key(samcache.hash_image(_screenshot(10)))).handle}; "
          f"for bob: {index.get(Namespace('tiny-qwen2.5-vl', tenant='bob').key(samcache.hash_image(_screenshot(10))))}")

    pool.check_invariants()
    index.check_invariants()
    print(f"\ninvariants hold; pool: {pool.stats()}")


if __name__ == "__main__":
    main()
