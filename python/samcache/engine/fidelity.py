"""Fidelity of a served turn: the turn against a full prefill of the same prompt.

The reference computes every token (no prefix, no image KV) in a namespace no request uses, so
it never feeds or reads the serving caches (it may read the turn's ViT outputs: they do not depend
on the context). The comparison: next-token KL(full || turn), top-1 agreement, and the agreement
of N greedy tokens decoded from both KVs (the turn's prefill KV is kept by a copy-on-write fork,
so the turn's own decode does not disturb it). Both decodes run batched, one row each per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from samcache.compression.compaction import Compaction
from samcache.engine.executor import Executor, Prepared, RequestOptions
from samcache._checks import check_int
from samcache.engine.metrics import Fidelity, greedy_agreement, next_token_fidelity
from samcache.engine.prompt import Prompt
from samcache.errors import OutOfBlocks, PromptTooLong
from samcache.hashing import Namespace

REFERENCE_TENANT = "samcache/reference"


def reference_prefill(executor: Executor, prompt: Prompt, model_id: str,
                      vit_namespace: Namespace) -> tuple[Prepared, torch.Tensor]:
    """Every token of ``prompt`` computed, nothing reused or registered. The caller frees
    ``prepared.seq``."""
    options = RequestOptions(use_prefix=False, use_image_kv=False, register_prefix=False, store_images=False,
                             budget=None, vit_namespace=vit_namespace, store_vit=False)
    return executor.prefill(prompt, Namespace(model_id, REFERENCE_TENANT), options)


def greedy_decode(executor: Executor, seqs: Sequence[int], first: Sequence[int], position: int,
                  n_tokens: int, compactions: Sequence[Compaction | None] | None = None) -> list[list[int]]:
    """Greedy tokens from ``first[i]`` on for each sequence (none hashed), batched per step:
    ``n_tokens`` per sequence, ``first`` included. ``compactions``: each sequence's compacted
    layers (compressed prefills), None for none."""
    check_int("n_tokens", n_tokens, 1)
    if len(seqs) != len(first):
        raise ValueError(f"one first token per sequence: {len(seqs)} sequences, {len(first)} tokens")
    compactions = [None] * len(seqs) if compactions is None else list(compactions)
    if len(compactions) != len(seqs):
        raise ValueError(f"one compaction (or None) per sequence: {len(seqs)} sequences, {len(compactions)} given")
    tokens = [[t] for t in first]
    for step in range(n_tokens - 1):
        steps = [executor.decode_step(seq, toks[-1], position + step, hashed=False, compaction=c)
                 for seq, toks, c in zip(seqs, tokens, compactions)]
        logits = executor.forward(steps)
        for toks, row in zip(tokens, logits):
            toks.append(int(row.argmax()))
    return tokens


def measure_fidelity(executor: Executor, prompt: Prompt, logits: torch.Tensor, fork: int, n_tokens: int, *,
                     model_id: str, vit_namespace: Namespace, compaction: Compaction | None = None) -> Fidelity | None:
    """The turn (next-token ``logits``, its prefill KV kept in ``fork``, which this frees;
    ``compaction``: the turn's compacted layers) against a full prefill without compression. None,
    with a warning, when the reference does not fit the pool."""
    try:
        check_int("n_tokens", n_tokens, 1)
        ref, ref_logits = reference_prefill(executor, prompt, model_id, vit_namespace)
    except (PromptTooLong, OutOfBlocks) as e:
        executor.pool.free_sequence(fork)
        warnings.warn(f"fidelity not measured: the reference prefill does not fit the pool ({e})", stacklevel=3)
        return None
    except BaseException:
        executor.pool.free_sequence(fork)
        raise
    try:
        kl, top1 = next_token_fidelity(ref_logits, logits)
        mine, theirs = greedy_decode(executor, [fork, ref.seq], [int(logits.argmax()), int(ref_logits.argmax())],
                                     prompt.next_position, n_tokens, [compaction, None])
    except OutOfBlocks as e:  # the turn itself succeeded: keep it, skip the comparison
        warnings.warn(f"fidelity not measured: its greedy decodes do not fit the pool ({e})", stacklevel=3)
        return None
    finally:
        executor.pool.free_sequence(fork)
        executor.pool.free_sequence(ref.seq)
    agree, prefix, count = greedy_agreement(theirs, mine)
    return Fidelity(kl=kl, top1_agree=top1, greedy_agree=agree, greedy_match_prefix=prefix, greedy_tokens=count)


__all__ = ["REFERENCE_TENANT", "greedy_decode", "measure_fidelity", "reference_prefill"]
