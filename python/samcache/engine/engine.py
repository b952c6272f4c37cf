"""SAMcacheEngine: a chat API over the runner, with samcache's three cache levels.

A turn goes: images decoded and hashed -> prompt tokens and M-RoPE positions -> the reuse plan
(longest cached prefix, then every image whose KV is known, spliced in at its new positions with
its RoPE re-rotated, then the tokens to recompute) -> one forward step that computes only the
new tokens plus the recompute set -> sampling, decode, and registration of what was computed
(prefix blocks, ViT outputs, per-image KV) for the next turn. docs/design.md explains the plan.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from samcache import ops
from samcache._checks import SEED_LIMIT, check_fraction, check_int, check_seed
from samcache.block_pool import BlockPool
from samcache.engine.family import detect_family
from samcache.engine.images import ImageGeometry, prepare_image, preprocess_params
from samcache.engine.metrics import Fidelity, TurnMetrics, greedy_agreement, next_token_fidelity
from samcache.engine.prompt import Prompt, build_prompt, normalize_messages, user_message
from samcache.engine.runner import ForwardBatch, ModelRunner
from samcache.engine.sampling import Sampler
from samcache.engine.stores import TensorStore
from samcache.errors import OutOfBlocks, PromptTooLong
from samcache.hashing import Namespace
from samcache.recompute import (
    LayerBudget,
    ReusedSpan,
    SensitivityCurves,
    attention_relevance,
    plan_recompute,
    probe_layer_sensitivity,
    solve_layer_budget,
    span_positions,
)

_LOWEST = -(2**31)
_RELEVANCE_QUERIES = 32  # the prompt's last new tokens whose attention scores track 2


@dataclass
class ImageKV:
    """One image's K/V for every layer, with the M-RoPE positions its keys are rotated to."""

    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor
    positions: torch.Tensor  # int64 [3, tokens]


@dataclass
class Session:
    """A conversation: the engine renders its whole history each turn (prefix reuse makes the
    repeated part cheap). ``messages`` uses the chat format of :meth:`SAMcacheEngine.chat`."""

    messages: list[dict] = field(default_factory=list)
    tenant: str | None = None


@dataclass
class ChatResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-turn token) or "length"
    metrics: TurnMetrics

    def __str__(self) -> str:
        return self.text


@dataclass
class _Prefilled:
    """A sequence whose prompt KV is in the pool, with the logits after its last token."""

    seq: int
    prompt: Prompt
    logits: torch.Tensor
    metrics: TurnMetrics
    vit: dict[int, tuple]  # image index -> ViT output used this turn


def model_fingerprint(model_path: str | pathlib.Path) -> str:
    """A model id from the checkpoint's config and a sample of its weight bytes: two checkpoints
    with the same config but other weights (another seed, a fine-tune) get different ids."""
    path = pathlib.Path(model_path)
    h = xxhash.xxh3_64((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:  # 64 chunks of 64 KiB spread over the file
            for i in range(64):
                fh.seek(size * i // 64)
                h.update(fh.read(65536))
    return f"{path.name}:{h.hexdigest()}"


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    return device


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        named = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}
        if dtype not in named:
            raise ValueError(f"dtype must be one of {sorted(named)}, got {dtype!r}")
        dtype = named[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


class SAMcacheEngine:
    """A multimodal chat engine that never encodes or prefills a known image twice.

    >>> engine = SAMcacheEngine("/path/to/Qwen2.5-VL-checkpoint")
    >>> r1 = engine.chat(images=["diagram.png"], prompt="Explain this architecture diagram.")
    >>> r2 = engine.chat(images=["diagram.png"], prompt="Where does the data flow?")  # reuses it
    >>> r2.text, r2.metrics.ttft_s, r2.metrics.image_reused_tokens

    Cache levels (each can be switched off; ``cache_enabled=False`` switches off all three):
    ``vit_cache`` (vision-tower outputs by image content), ``prefix_cache`` (exact token prefix,
    images keyed by content) and ``image_kv_cache`` (an image's KV reused at any position, RoPE
    re-rotated, with ``recompute_ratio`` of its tokens recomputed, split across layers by
    ``recompute_budget``: ``"layer-aware"`` solves per-layer rates from sensitivity curves
    (:meth:`calibrate`, or ``sensitivity=`` curves / a JSON path), ``"uniform"`` uses the same
    rate at every layer).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        cache_enabled: bool = True,
        compression_enabled: bool = False,
        recompute_ratio: float = 0.05,
        recompute_budget: str = "layer-aware",
        sensitivity: SensitivityCurves | str | os.PathLike | None = None,
        head_fraction: float = 0.1,
        track2_share: float = 0.5,
        recompute_tracks: str = "both",
        prefix_cache: bool = True,
        vit_cache: bool = True,
        image_kv_cache: bool = True,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        vit_cache_bytes: int = 256 << 20,
        image_kv_cache_bytes: int | None = None,
        model_id: str | None = None,
        tenant: str | None = None,
        seed: int = 0,
        share_weights_with: "SAMcacheEngine | None" = None,
    ) -> None:
        if compression_enabled:
            raise ValueError(
                "compression_enabled=True needs the router-logit visual-token compression policy, "
                "which this version does not have yet; use compression_enabled=False"
            )
        for name, value in (("recompute_ratio", recompute_ratio), ("head_fraction", head_fraction),
                            ("track2_share", track2_share)):
            check_fraction(name, value)
        for name, value, optional in (("block_size", block_size, False), ("num_blocks", num_blocks, True),
                                      ("kv_cache_bytes", kv_cache_bytes, True), ("vit_cache_bytes", vit_cache_bytes, False),
                                      ("image_kv_cache_bytes", image_kv_cache_bytes, True)):
            if value is not None or not optional:
                check_int(name, value, 1)
        check_seed(seed)
        if recompute_tracks not in ("both", "heads"):
            raise ValueError(f"recompute_tracks must be 'both' or 'heads', got {recompute_tracks!r}")
        if recompute_budget not in ("layer-aware", "uniform"):
            raise ValueError(f"recompute_budget must be 'layer-aware' or 'uniform', got {recompute_budget!r}")
        self.model_path = pathlib.Path(model_path)
        self.family = detect_family(self.model_path)
        fingerprint = model_fingerprint(self.model_path)
        self._weights_digest = fingerprint.rsplit(":", 1)[1]  # without the folder name
        if share_weights_with is not None and self._weights_digest != share_weights_with._weights_digest:
            raise ValueError(f"share_weights_with holds the weights of {share_weights_with.model_path}, "
                             f"not those of {self.model_path}")
        self.device = _resolve_device(device)
        self.dtype = _resolve_dtype(dtype, self.device)
        if kv_cache_bytes is None:
            kv_cache_bytes = (8 << 30) if self.device.type == "cuda" else (256 << 20)
        self.runner = ModelRunner(
            self.model_path, self.family, device=self.device, dtype=self.dtype, block_size=block_size,
            num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
            model=share_weights_with.runner.model if share_weights_with is not None else None,
        )
        self.pool = BlockPool(self.runner.num_blocks, block_size)
        from samcache.models import load_processor

        self.processor = load_processor(self.model_path)
        self.tokenizer = self.processor.tokenizer
        self.geometry = ImageGeometry.from_processor(self.processor.image_processor)
        self._preprocess = preprocess_params(self.processor.image_processor)
        cfg = self.runner.config
        self.image_token_id = int(cfg.image_token_id)
        eos = getattr(self.runner.model.generation_config, "eos_token_id", None) or cfg.text_config.eos_token_id
        self.eos_token_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

        self.model_id = model_id or fingerprint
        self.tenant = tenant
        self.use_prefix = cache_enabled and prefix_cache
        self.use_vit_cache = cache_enabled and vit_cache
        self.use_image_kv = cache_enabled and image_kv_cache
        self.recompute_ratio = float(recompute_ratio)
        self.recompute_budget = recompute_budget
        self.head_fraction = head_fraction
        self.track2_share = track2_share
        self.recompute_tracks = recompute_tracks
        self.sensitivity = self._load_sensitivity(sensitivity)
        self._warned_uniform = False
        self._solved: dict = {}
        self.vit_store = TensorStore("vit", vit_cache_bytes)
        self.image_kv_store = TensorStore("image_kv", image_kv_cache_bytes or kv_cache_bytes)
        self.seed = seed
        self._turns = 0

    # ---- public API ---------------------------------------------------------------------------
    def new_session(self, system: str | None = None, *, tenant: str | None = None) -> Session:
        """A conversation, optionally with a system prompt, scoped to ``tenant`` (default: the engine's)."""
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str, got {type(system).__name__}")
        messages = [{"role": "system", "content": system}] if system is not None else []
        return Session(messages=messages, tenant=tenant if tenant is not None else self.tenant)

    def chat(
        self,
        images: Sequence[Any] | None = None,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        session: Session | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        tenant: str | None = None,
        fidelity: bool = False,
        fidelity_tokens: int = 8,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> ChatResult:
        """One turn. Either ``images`` + ``prompt`` (a user message; appended to ``session`` if
        given) or the whole ``messages`` list (``{"role", "content"}`` dicts; content is a string
        or a list of ``{"type": "text", "text"}`` / ``{"type": "image", "image"}`` parts, images as
        paths, PIL images or uint8 arrays).

        ``fidelity=True`` also runs a full prefill of the same prompt and reports the next-token
        KL, top-1 agreement and the agreement of ``fidelity_tokens`` greedy tokens
        (``metrics.fidelity``); it is not counted in TTFT. ``ignore_eos=True`` always decodes
        ``max_new_tokens`` (benchmarks: the same work in every mode).
        """
        start = time.perf_counter()
        check_int("max_new_tokens", max_new_tokens, 1)
        if fidelity:
            check_int("fidelity_tokens", fidelity_tokens, 1)
        sampler = Sampler(temperature, top_p, seed=(self.seed + self._turns) % SEED_LIMIT if seed is None else seed)
        if messages is not None:
            if images is not None or prompt is not None or session is not None:
                raise ValueError("pass either messages=... or images/prompt (with an optional session), not both")
            history = messages  # checked by build_prompt; no session to extend
        else:
            if isinstance(images, (str, os.PathLike, bytes)) or not isinstance(images, (Sequence, type(None))):
                raise TypeError(f"images must be a list of images (paths, PIL images, arrays), got {type(images).__name__}")
            if prompt is None and not images:
                raise ValueError("chat needs a prompt or images (or messages=...)")
            prompt = "" if prompt is None else prompt  # an image-only turn
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            turn = user_message(list(images or []), prompt)
            history = (list(session.messages) if session is not None else []) + [turn]
        if tenant is None:
            tenant = session.tenant if session is not None else self.tenant
        namespace = Namespace(self.model_id, tenant)
        self._turns += 1

        prompt_ = self.build_prompt(history)
        self._check_fits(prompt_, max_new_tokens)
        pre = self.prefill(prompt_, namespace)
        fork = None
        try:
            first = sampler(pre.logits)
            pre.metrics.ttft_s = time.perf_counter() - start
            fork = self.pool.fork(pre.seq) if fidelity else None  # the prefill's KV, kept for the comparison
            self._register(pre, namespace)
            tokens, reason, decode_s = self._decode(pre.seq, first, prompt_.next_position, max_new_tokens, sampler,
                                                    register=self.use_prefix, ignore_eos=ignore_eos)
            m = pre.metrics
            m.decode_tokens = len(tokens)
            m.decode_tokens_per_s = (len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0
            block_bytes = self.pool.block_size * self.runner.kv_bytes_per_token
            m.kv_bytes = len(self.pool.block_table(pre.seq)) * block_bytes
            m.kv_pool_bytes = (self.pool.num_blocks - self.pool.stats()["free_blocks"]) * block_bytes
            m.image_kv_store_bytes = self.image_kv_store.used_bytes
            m.latency_s = time.perf_counter() - start
        except BaseException:
            if fork is not None:
                self.pool.free_sequence(fork)
            # A decode step registers a block's hash before its KV is written: drop what decode added.
            self._discard(pre.seq, table_from=len(prompt_) // self.pool.block_size, hashed=self.use_prefix)
            raise
        self.pool.free_sequence(pre.seq)
        if fork is not None:
            m.fidelity = self._fidelity(prompt_, pre, fork, fidelity_tokens, namespace)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if session is not None:
            session.messages = history + [{"role": "assistant", "content": text}]
        return ChatResult(text=text, token_ids=tokens, finish_reason=reason, metrics=m)

    def warm_up(self, size: tuple[int, int] = (56, 56)) -> None:
        """One throwaway turn over a synthetic image of ``size`` (h, w) no real prompt holds, so
        first-call costs (allocations, the image path) stay out of the first measured turn. Its
        own system prompt: no later prompt gets a prefix hit from it."""
        from samcache.engine.synthetic import screenshot

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.chat(messages=[{"role": "system", "content": "samcache warm-up"},
                                user_message([screenshot(987_654_321, size)], "warm-up")], max_new_tokens=2)

    def build_prompt(self, messages: Sequence[dict]) -> Prompt:
        """Chat messages -> token ids, image spans and M-RoPE positions (images decoded and hashed)."""
        rendered, raw_images = normalize_messages(messages)
        images = [prepare_image(im, self.geometry, self._preprocess) for im in raw_images]
        text = self.processor.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return build_prompt(ids, images, image_token_id=self.image_token_id, merge_size=self.geometry.merge_size)

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the pool or a store is inconsistent."""
        self.pool.check_invariants()
        self.vit_store.check_invariants()
        self.image_kv_store.check_invariants()

    # ---- the reuse plan and the prefill -------------------------------------------------------
    def _check_fits(self, prompt: Prompt, max_new_tokens: int) -> None:
        n = len(prompt)
        if prompt.next_position + max_new_tokens > self.runner.max_positions:
            raise PromptTooLong(
                f"the prompt reaches position {prompt.next_position} and {max_new_tokens} new tokens would pass "
                f"the model's {self.runner.max_positions} positions"
            )
        need = -(-(n + max_new_tokens) // self.pool.block_size)
        if need > self.pool.num_blocks:
            raise PromptTooLong(
                f"the prompt ({n} tokens) plus {max_new_tokens} new tokens needs {need} KV blocks of "
                f"{self.pool.block_size} tokens but the pool has {self.pool.num_blocks} "
                f"({self.pool.num_blocks * self.pool.block_size} tokens); raise kv_cache_bytes or num_blocks"
            )

    def prefill(
        self,
        prompt: Prompt,
        namespace: Namespace,
        *,
        use_prefix: bool | None = None,
        use_image_kv: bool | None = None,
        register: bool | None = None,
        recompute_ratio: float | None = None,
        kv_override: Callable[[np.ndarray], None] | None = None,
        vit_namespace: Namespace | None = None,
        store_vit: bool = True,
    ) -> _Prefilled:
        """Put ``prompt``'s KV into a new sequence of the pool and return it with the next-token
        logits. The caller frees ``result.seq``. Arguments default to the engine's settings;
        ``register=False`` keeps the sequence's blocks out of the prefix cache, and
        ``kv_override(block_table)`` runs after reused KV is spliced in (the sensitivity probe);
        ``vit_namespace`` is where ViT outputs are looked up and kept (default ``namespace``;
        ``store_vit=False`` only looks)."""
        use_prefix = self.use_prefix if use_prefix is None else use_prefix
        use_image_kv = self.use_image_kv if use_image_kv is None else use_image_kv
        register = self.use_prefix if register is None else register
        ratio = self.recompute_ratio if recompute_ratio is None else recompute_ratio
        vit_ns = namespace if vit_namespace is None else vit_namespace
        bs = self.pool.block_size
        n = len(prompt)
        m = TurnMetrics(prompt_tokens=n, images=len(prompt.images))
        seq = self.pool.new_sequence(namespace)
        adopted = 0
        try:
            # 1. Exact prefix: never the last token, whose logits this step must produce.
            if use_prefix and n > 1:
                adopted = self.pool.adopt_prefix(seq, prompt.token_ids[: n - 1], prompt.extra_keys(n - 1))
            more = -(-n // bs) - adopted // bs
            if more > self.pool.num_free_blocks():
                raise PromptTooLong(
                    f"the prompt needs {more} more KV blocks but only {self.pool.num_free_blocks()} are free or evictable"
                )
            rest = prompt.token_ids[adopted:]
            res = (self.pool.append_tokens(seq, rest, prompt.extra_keys()) if register
                   else self.pool.append_slots(seq, rest.size))
            self.runner.copy_on_write(res.copies)
            table = self.pool.block_table(seq)
            m.prefix_reused_tokens = adopted

            # 2. Known images after the prefix: splice their KV in at the new positions.
            is_new = np.zeros(n, dtype=bool)
            is_new[adopted:] = True
            reused: list[int] = []  # indices of the images whose KV is spliced in
            spans: list[ReusedSpan] = []
            for i, span in enumerate(prompt.images):
                lo = max(span.start, adopted)
                if lo >= span.end or not use_image_kv:
                    continue
                kv = self.image_kv_store.get(namespace.key(span.image.content), check=self._kv_check(span))
                if kv is None:
                    m.image_kv_misses += 1
                    continue
                m.image_kv_hits += 1
                off = lo - span.start  # the prefix may already hold the image's first tokens
                self.runner.splice(kv.k[:, off:], kv.v[:, off:], prompt.positions[:, lo: span.end] - kv.positions[:, off:],
                                   table, np.arange(lo, span.end))
                is_new[lo: span.end] = False
                reused.append(i)
                spans.append(ReusedSpan(lo, span.end - lo))
            m.image_reused_tokens = sum(s.length for s in spans)
            new_index = np.flatnonzero(is_new)
            m.prefilled_tokens = int(new_index.size)
            if kv_override is not None:
                kv_override(table)

            # 3. The budget, one ViT call (new images, and reused ones when some of their tokens
            # are recomputed), then the recompute plan.
            quota = []
            if m.image_reused_tokens:
                budget = self._budget(ratio)
                quota = [min(q, m.image_reused_tokens) for q in budget.tokens_per_layer(m.image_reused_tokens)]
            recompute = bool(quota) and quota[0] > 0
            vit: dict[int, tuple] = {}
            fresh = [i for i, s in enumerate(prompt.images) if is_new[s.start:s.end].any()]
            self._ensure_vit(prompt, fresh + (reused if recompute else []), vit, m, vit_ns, store_vit)
            layer_sets: list[np.ndarray] = []
            if recompute:
                scores = self._relevance(prompt, new_index, spans, table, vit) if self.recompute_tracks == "both" else None
                plan = plan_recompute(spans, quota, scores, head_fraction=self.head_fraction,
                                      track2_share=self.track2_share, tracks=self.recompute_tracks)
                quota = list(plan.quota)  # "heads" stops at the span heads
                layer_sets = [plan.positions(layer) for layer in range(self.runner.num_layers)]
            m.recompute_rates = [q / m.image_reused_tokens for q in quota] if quota else [0.0] * self.runner.num_layers
            index = np.union1d(new_index, layer_sets[0]) if layer_sets else new_index
            m.recomputed_tokens = int(index.size - new_index.size)
            m.recomputed_token_layers = int(sum(quota))

            # 4. One forward step over the computed rows.
            batch = self._batch(prompt, index, table, vit)
            if layer_sets:
                batch.layer_rows = []
                for layer in range(self.runner.num_layers):
                    active = np.union1d(new_index, layer_sets[layer])
                    batch.layer_rows.append(None if active.size == index.size
                                            else torch.from_numpy(np.searchsorted(index, active)))
            logits = self.runner.forward(batch)
        except BaseException:
            self._discard(seq, table_from=adopted // bs, hashed=register)
            raise
        return _Prefilled(seq=seq, prompt=prompt, logits=logits, metrics=m, vit=vit)

    def _kv_check(self, span) -> tuple:
        return (span.image.grid, span.length, self.runner.num_layers)

    def _ensure_vit(self, prompt: Prompt, image_indices: list[int], vit: dict, m: TurnMetrics,
                    namespace: Namespace, store: bool) -> None:
        """ViT outputs of these images (from the cache, else one batched vision-tower call); ``store``
        keeps new ones in the cache."""
        missing = []
        for i in image_indices:
            if i in vit:
                continue
            span = prompt.images[i]
            hit = self.vit_store.get(namespace.key(span.image.content), check=span.image.grid) if self.use_vit_cache else None
            if hit is not None:
                vit[i] = hit
                m.vit_hits += 1
            else:
                missing.append(i)
        if not missing:
            return
        pixels = [prompt.images[i].image.pixels for i in missing]
        # Always HxWx3: left to guess, the processor reads a 1- or 3-pixel-tall image as channels-first.
        inputs = self.processor.image_processor(images=pixels, return_tensors="pt", input_data_format="channels_last")
        outputs = self.runner.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
        for i, out in zip(missing, outputs):
            span = prompt.images[i]
            if tuple(out[0].shape) != (span.length, self.runner.hidden_size):
                raise RuntimeError(f"vision tower returned {tuple(out[0].shape)} for an image of {span.length} tokens")
            vit[i] = out
            m.vit_calls += 1
            if self.use_vit_cache and store:
                # Keyed by tenant too: the output does not depend on it, but a hit would tell one
                # tenant (through its TTFT and metrics) that another has sent this image.
                self.vit_store.put(namespace.key(span.image.content), out, check=span.image.grid)

    def _image_rows(self, prompt: Prompt, index: np.ndarray):
        """For each image with tokens among the (sorted) rows ``index``: (image, lo, hi, offsets),
        rows [lo, hi) being its tokens at ``offsets`` within the image (on the model's device)."""
        for i, span in enumerate(prompt.images):
            lo, hi = np.searchsorted(index, [span.start, span.end])
            if hi > lo:
                yield i, lo, hi, torch.from_numpy(index[lo:hi] - span.start).to(self.runner.device)

    def _embeds(self, prompt: Prompt, index: np.ndarray, vit: dict) -> torch.Tensor:
        r = self.runner
        ids = torch.from_numpy(prompt.token_ids[index].astype(np.int64))
        out = r.embed_tokens(ids).to(r.dtype)
        for i, lo, hi, offsets in self._image_rows(prompt, index):
            out[lo:hi] = vit[i][0][offsets]
        return out

    def _batch(self, prompt: Prompt, index: np.ndarray, table: np.ndarray, vit: dict) -> ForwardBatch:
        r = self.runner
        rows_index = torch.from_numpy(index.astype(np.int64))
        batch = ForwardBatch(
            index=rows_index,
            embeds=self._embeds(prompt, index, vit),
            positions=prompt.positions[:, rows_index],
            slots=torch.from_numpy(r.slots_for(table, index)),
            block_table=torch.from_numpy(table),
            num_kv_tokens=len(prompt),
        )
        if self.family.deepstack and r.deepstack_layers:
            rows = torch.full((index.size,), -1, dtype=torch.int64)
            feats: list[list[torch.Tensor]] = [[] for _ in range(r.deepstack_layers)]
            count = 0
            for i, lo, hi, offsets in self._image_rows(prompt, index):
                rows[lo:hi] = torch.arange(count, count + hi - lo)
                count += hi - lo
                for layer, f in enumerate(vit[i][1]):
                    feats[layer].append(f[offsets])
            if count:
                batch.deepstack_rows = rows
                batch.deepstack_features = [torch.cat(f) for f in feats]
        return batch

    def _relevance(self, prompt: Prompt, new_index: np.ndarray, spans: list[ReusedSpan], table: np.ndarray,
                   vit: dict) -> np.ndarray:
        """Track-2 scores: attention of the prompt's last new tokens (at the first layer, whose KV of
        reused tokens is exact after re-rotation) on every reused token."""
        r = self.runner
        scores = np.zeros(len(prompt), dtype=np.float64)
        queries = new_index[-_RELEVANCE_QUERIES:]
        if not queries.size or not spans:
            return scores
        reused = span_positions(spans)
        q = r.layer0_queries(self._embeds(prompt, queries, vit), prompt.positions[:, torch.from_numpy(queries)])
        keys = r.layer_keys(0, table, reused)
        scores[reused] = attention_relevance(q, keys).double().cpu().numpy()
        return scores

    def _budget(self, ratio: float) -> LayerBudget:
        layers = self.runner.num_layers
        if ratio <= 0.0:
            return LayerBudget(rates=np.zeros(layers), expected_loss=0.0, mean_rate=0.0)
        if self.recompute_budget == "layer-aware" and self.sensitivity is not None:
            key = (id(self.sensitivity), ratio)  # the solve is the same for every turn: keep it
            if key not in self._solved:
                self._solved = {key: solve_layer_budget(self.sensitivity, ratio)}
            return self._solved[key]
        if self.recompute_budget == "layer-aware" and not self._warned_uniform:
            warnings.warn(
                "no sensitivity curves for this model yet: the recompute budget is uniform across layers "
                "until engine.calibrate() runs (or pass sensitivity=...)", stacklevel=4,  # the caller of chat
            )
            self._warned_uniform = True
        return LayerBudget(rates=np.full(layers, ratio), expected_loss=float("nan"), mean_rate=ratio)

    def _discard(self, seq: int, *, table_from: int, hashed: bool) -> None:
        """Drop a sequence whose KV may be incomplete, so no later request adopts its blocks."""
        try:
            blocks = self.pool.block_table(seq)[table_from:]
        except Exception:  # noqa: BLE001 - the sequence is already gone
            return
        cached = [int(b) for b in blocks if hashed and self.pool.block_hash(int(b)) is not None]
        if cached:
            self.pool.set_block_priority(np.asarray(cached, dtype=np.int32), _LOWEST)
        self.pool.free_sequence(seq)
        # Ours that are now cached and unreferenced (a duplicate of a block cached elsewhere was
        # freed and lost its hash; one still shared stays): evicted first, being lowest priority.
        ours = [b for b in cached if self.pool.refcount(b) == 0 and self.pool.block_hash(b) is not None]
        if ours:
            self.pool.evict(len(ours))

    # ---- after the prefill --------------------------------------------------------------------
    def _register(self, pre: _Prefilled, namespace: Namespace) -> None:
        """Keep each image's KV (with its positions) for reuse at any position."""
        if not self.use_image_kv:
            return
        r = self.runner
        table = self.pool.block_table(pre.seq)
        for span in pre.prompt.images:
            key = namespace.key(span.image.content)
            if key in self.image_kv_store:
                continue
            k, v = r.gather_kv(table, np.arange(span.start, span.end))
            kv = ImageKV(k=k, v=v, positions=pre.prompt.positions[:, span.start: span.end].clone())
            self.image_kv_store.put(key, kv, check=self._kv_check(span))

    def _decode(self, seq: int, first: int, position: int, max_new_tokens: int, sampler, *, register: bool,
                ignore_eos: bool = False):
        """Tokens from ``first`` on, each fed back through the runner, until an end token or the limit."""
        r = self.runner
        tokens, token = [first], first
        start = time.perf_counter()
        while (ignore_eos or token not in self.eos_token_ids) and len(tokens) < max_new_tokens:
            res = self.pool.append_tokens(seq, [token]) if register else self.pool.append_slots(seq, 1)
            r.copy_on_write(res.copies)
            n = self.pool.num_tokens(seq)
            batch = ForwardBatch(
                index=torch.tensor([n - 1]),
                embeds=r.embed_tokens(torch.tensor([token])),
                positions=torch.full((3, 1), position + len(tokens) - 1, dtype=torch.int64),
                slots=torch.from_numpy(res.slots.astype(np.int64)),
                block_table=torch.from_numpy(self.pool.block_table(seq)),
                num_kv_tokens=n,
            )
            token = sampler(r.forward(batch))
            tokens.append(token)
        reason = "stop" if token in self.eos_token_ids else "length"
        return tokens, reason, time.perf_counter() - start

    def _fidelity(self, prompt: Prompt, pre: _Prefilled, fork: int, n_tokens: int,
                  namespace: Namespace) -> Fidelity | None:
        """The turn (its KV kept in ``fork``) against a full prefill of the same prompt."""
        greedy = Sampler(0.0)
        try:
            ref = self._full_prefill(prompt, vit_namespace=namespace)
        except (PromptTooLong, OutOfBlocks) as e:
            self.pool.free_sequence(fork)
            warnings.warn(f"fidelity not measured: the reference prefill does not fit the pool ({e})", stacklevel=3)
            return None
        except BaseException:
            self.pool.free_sequence(fork)
            raise
        try:
            kl, top1 = next_token_fidelity(ref.logits, pre.logits)
            mine, _, _ = self._decode(fork, greedy(pre.logits), prompt.next_position, n_tokens, greedy, register=False)
            theirs, _, _ = self._decode(ref.seq, greedy(ref.logits), prompt.next_position, n_tokens, greedy,
                                        register=False)
        except OutOfBlocks as e:  # the turn itself succeeded: keep it, skip the comparison
            warnings.warn(f"fidelity not measured: its greedy decodes do not fit the pool ({e})", stacklevel=3)
            return None
        finally:
            self.pool.free_sequence(fork)
            self.pool.free_sequence(ref.seq)
        agree, prefix, count = greedy_agreement(theirs, mine)
        return Fidelity(kl=kl, top1_agree=top1, greedy_agree=agree, greedy_match_prefix=prefix, greedy_tokens=count)

    def _full_prefill(self, prompt: Prompt, vit_namespace: Namespace) -> _Prefilled:
        """The reference: every token computed, nothing reused (ViT outputs may come from the
        cache of ``vit_namespace``, the caller's: they do not depend on the context). Not
        registered in any cache."""
        return self.prefill(prompt, Namespace(self.model_id, "samcache/reference"), use_prefix=False,
                            use_image_kv=False, register=False, recompute_ratio=0.0, vit_namespace=vit_namespace,
                            store_vit=False)

    # ---- the layer-aware budget ---------------------------------------------------------------
    def _load_sensitivity(self, sensitivity) -> SensitivityCurves | None:
        if sensitivity is None or isinstance(sensitivity, SensitivityCurves):
            if sensitivity is not None and sensitivity.num_layers != self.runner.num_layers:
                raise ValueError(f"sensitivity curves have {sensitivity.num_layers} layers, the model has "
                                 f"{self.runner.num_layers}")
            return sensitivity
        path = pathlib.Path(sensitivity)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"sensitivity={str(path)!r}: cannot read the curves file ({e.strerror or e})") from None
        try:
            data = json.loads(text)
            curves = SensitivityCurves(rates=np.asarray(data["rates"]), loss=np.asarray(data["loss"]))
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a sensitivity-curves JSON saved by engine.calibrate(save=...): {e!r}") from None
        if data.get("model_id") not in (None, self.model_id):
            raise ValueError(f"{path} was calibrated on model {data['model_id']}, not on this one ({self.model_id}); "
                             "calibrate this model (engine.calibrate(save=...))")
        return self._load_sensitivity(curves)

    def calibrate(
        self,
        images: Sequence[Any] | None = None,
        *,
        rates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        save: str | os.PathLike | None = None,
        progress: bool = True,
    ) -> SensitivityCurves:
        """Measure each layer's sensitivity offline and use the layer-aware budget from now on.

        A calibration request shows ``images`` (default: two synthetic screenshots) once, then
        again at new positions behind another system prompt. For each layer and rate, the reused
        turn gets the exact KV (from a full prefill) for that fraction of its image tokens at that
        layer only; the loss is the next-token KL against the full prefill. ``save`` writes the
        curves as JSON (load them with ``sensitivity=path``).
        """
        from samcache.engine.synthetic import screenshot

        images = list(images) if images is not None else [screenshot(101, (224, 320)), screenshot(102, (224, 320))]
        ns = Namespace(self.model_id, "samcache/calibration")
        prime = self.build_prompt([{"role": "system", "content": "Calibration."}, user_message(images, "Describe.")])
        target = self.build_prompt([
            {"role": "system", "content": "You are an agent operating a computer. Earlier steps are above."},
            user_message(images[::-1], "What changed between these screenshots, and what should be clicked next?"),
        ])
        self._check_fits(target, 1)
        saved = (self.use_image_kv, self.use_vit_cache)
        self.use_image_kv = self.use_vit_cache = True
        store = self.image_kv_store
        self.image_kv_store = TensorStore("calibration", max(store.index.capacity_bytes, 1))
        r = self.runner
        try:
            with self._sequence(self.prefill(prime, ns, use_prefix=False, register=False, recompute_ratio=0.0)) as pre:
                self._register(pre, ns)
            spans = [ReusedSpan(s.start, s.length) for s in target.images]
            reused = span_positions(spans)
            # The order the served plan uses: relevance scores from the reused turn itself.
            with self._sequence(self.prefill(target, ns, use_prefix=False, register=False, recompute_ratio=0.0)) as run:
                if run.metrics.image_kv_hits != len(target.images):  # else every "reused" turn is exact: loss 0
                    need = sum(s.length for s in target.images) * r.kv_bytes_per_token
                    raise ValueError(
                        f"calibration needs the KV of its {len(target.images)} images in the image-KV store "
                        f"(about {need:,} bytes), but only {run.metrics.image_kv_hits} fit in its "
                        f"{store.index.capacity_bytes:,} bytes; raise image_kv_cache_bytes or calibrate with smaller images")
                new_index = np.setdiff1d(np.arange(len(target)), reused)
                scores = self._relevance(target, new_index, spans, self.pool.block_table(run.seq), run.vit)
            order = plan_recompute(spans, [reused.size], scores, head_fraction=self.head_fraction,
                                   track2_share=self.track2_share, tracks=self.recompute_tracks).order
            with self._sequence(self._full_prefill(target, ns)) as ref:
                exact_k, exact_v = r.gather_kv(self.pool.block_table(ref.seq), order)

            def measure(layer: int, rate: float) -> float:
                k = math.ceil(rate * order.size - 1e-9)

                def override(table: np.ndarray) -> None:
                    if k:
                        ops.paged_write(exact_k[layer, :k], exact_v[layer, :k], r.k_cache[layer], r.v_cache[layer],
                                        r.slot_tensor(table, order[:k]))

                with self._sequence(self.prefill(target, ns, use_prefix=False, register=False, recompute_ratio=0.0,
                                                 kv_override=override)) as run:
                    return next_token_fidelity(ref.logits, run.logits)[0]

            curves = probe_layer_sensitivity(measure, r.num_layers, rates, progress=progress)
        finally:
            self.use_image_kv, self.use_vit_cache = saved
            self.image_kv_store = store
        self.sensitivity = curves
        if save is not None:
            pathlib.Path(save).write_text(json.dumps({"model_id": self.model_id, "rates": curves.rates.tolist(),
                                                      "loss": curves.loss.tolist()}, indent=1), encoding="utf-8")
        return curves

    @contextlib.contextmanager
    def _sequence(self, pre: _Prefilled):
        """``with self._sequence(self.prefill(...)) as pre:`` frees the sequence however the block ends."""
        try:
            yield pre
        finally:
            self.pool.free_sequence(pre.seq)

    def __repr__(self) -> str:
        return (f"SAMcacheEngine({self.family.name}, {self.device}, {self.dtype}, pool={self.pool.num_blocks}x"
                f"{self.pool.block_size}, recompute={self.recompute_ratio} {self.recompute_budget})")


__all__ = ["ChatResult", "ImageKV", "SAMcacheEngine", "Session", "model_fingerprint"]
