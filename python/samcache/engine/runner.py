"""The model runner: Hugging Face weights, samcache's paged KV and its own batched layer loop.

transformers' modules provide the weights and the per-token math (norms, MoE experts, the vision
tower); the runner owns the loop over layers, so it decides which rows each layer computes. One
forward step serves a whole :class:`StepBatch` (many sequences, prefill and decode rows mixed):
at layer ``l`` only that layer's rows are computed (new tokens plus the recompute set, shrinking
with depth); their K/V go into the sequences' slots of the layer's paged cache and their queries
attend to their whole sequence through ``samcache.ops.sparse_attention``, with the step's metadata
built once. Every other position keeps the KV already in the pool (an adopted prefix, or an
image's KV spliced in at its new positions).

On the CPU the projections and MLPs run through oneDNN (``samcache.engine.linear``), q/k/v and
gate/up as one fused GEMM each (their weights are re-laid out once, in place, as views of one
tensor: no second copy).
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Sequence

import numpy as np
import torch

from samcache import ops
from samcache.cache.block_pool import slot_ids
from samcache.engine.batch import StepBatch
from samcache.families import Family
from samcache.engine.layer_parts import frequency_axes, fuse_linear, plain_rms_norm
from samcache.engine.linear import linear
from samcache.engine.vision import fast_vision
from samcache.errors import UnsupportedModel


_MLP_ROWS = 1024  # rows per MLP chunk: 1,024 x (2 x 768) float32 intermediates are 6 MB


class ModelRunner:
    """Loads a checkpoint of ``family`` and runs forward steps over a paged KV cache of
    ``num_blocks`` x ``block_size`` tokens per layer."""

    def __init__(self, model_path: str | pathlib.Path, family: Family, *, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int | None = None,
                 kv_cache_bytes: int = 256 << 20, model=None) -> None:
        self.family = family
        self.device = device
        self.dtype = dtype
        if model is None:
            model = family.model_class().from_pretrained(str(model_path), dtype=dtype)
            model.to(device).eval().requires_grad_(False)
        else:
            weights = next(model.parameters())
            same_device = weights.device.type == device.type and (device.index is None or
                                                                  weights.device.index == device.index)
            if type(model).__name__ != family.architecture or weights.dtype != dtype or not same_device:
                raise ValueError(f"a shared model must be a {family.architecture} in {dtype} on {device}, got a "
                                 f"{type(model).__name__} in {weights.dtype} on {weights.device}")
        self.model = model
        self.config = model.config
        self.text = model.model.language_model
        self.layers = list(self.text.layers)
        self.lm_head = model.lm_head
        cfg = self.config.text_config
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = int(cfg.max_position_embeddings)
        rotary = self.text.rotary_emb
        if float(rotary.attention_scaling) != 1.0 or rotary.rope_type != "default":
            raise UnsupportedModel(
                f"rope_type {rotary.rope_type!r} (attention scaling {rotary.attention_scaling}) is not supported: "
                "re-rotating cached keys assumes plain (M-)RoPE"
            )
        self.inv_freq = rotary.inv_freq.detach().float().to(device)
        # Positions are [3, N] everywhere in the engine; 1-D RoPE families rotate by row 0.
        self.mrope_section = [int(s) for s in rotary.mrope_section] if family.mrope else []
        half = self.inv_freq.numel()
        self._freq_axes = frequency_axes(family.rope_style, self.mrope_section, half).to(device)
        self._sin_sign = torch.cat((-torch.ones(half), torch.ones(half))).to(device, dtype)  # rotate_half's sign
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        self.windows = [int(cfg.sliding_window) if t == "sliding_attention" else -1 for t in layer_types]
        # Fused projections: q/k/v of every layer, gate/up of dense MLPs.
        self._qkv = [fuse_linear([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], "qkv") for l in self.layers]
        self._gate_up = [fuse_linear([l.mlp.gate_proj, l.mlp.up_proj], "gate_up") if hasattr(l.mlp, "gate_proj") else None
                         for l in self.layers]
        # The layer loop's norms and its RoPE + KV write as one samcache kernel each (a few ops per
        # layer instead of about fifty: on a GPU each op is a launch) where the model's math is the
        # kernels' own; otherwise the model's modules.
        self.fused_norms = all(plain_rms_norm(m) for l in self.layers
                               for m in (l.input_layernorm, l.post_attention_layernorm))
        self.fused_rope = not family.qk_norm and 2 * self.inv_freq.numel() == self.head_dim
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = kv_cache_bytes // self.block_bytes
            if num_blocks < 1:
                raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no KV block: one block of {block_size} "
                                 f"tokens takes {self.block_bytes} bytes")
        self.num_blocks = num_blocks
        shape = (self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # One tensor per K/V for all layers: layer l's cache is the contiguous view [l], and an image's
        # KV for every layer is spliced in with one fused re-rotate-and-write call.
        # Zeroed once here, though attention reads only slots a sequence has written: every page is
        # touched at start-up, not by the first turn that writes it (on the CPU a first-touch page
        # fault per 4 KiB of new KV made a turn that reuses nothing ~4-8% slower than a full prefill
        # running in recycled blocks).
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._layer_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0)))  # views, taken once
        self.visual = getattr(model.model, family.vision_attr)
        self.deepstack_layers = len(getattr(self.config.vision_config, "deepstack_visual_indexes", []) or [])

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """K and V of one block, every layer."""
        return self.block_size * self.kv_bytes_per_token

    # ---- inputs --------------------------------------------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(token_ids.to(self.device))

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[torch.Tensor, tuple]]:
        """ViT outputs per image: (embeds [tokens, hidden], DeepStack features per layer or ()).
        ``grid_thw``: each image's patch grid (Qwen), or each image's tile count (InternVL:
        ``num_patches``, the tiles of all images stacked in ``pixel_values``)."""
        if self.family.vision_input == "tiles":
            out = self.model.model.get_image_features(pixel_values.to(self.device, self.dtype), return_dict=True)
            tiles = [int(n) for n in torch.as_tensor(grid_thw).reshape(-1).tolist()]
            per_image = out.pooler_output.split(tiles)  # [tiles, tokens per tile, hidden] each
            return [(e.reshape(-1, e.shape[-1]).to(self.dtype), ()) for e in per_image]
        with fast_vision(self.visual) if self.device.type == "cpu" else contextlib.nullcontext():
            out = self.model.model.get_image_features(
                pixel_values.to(self.device, self.dtype), grid_thw.to(self.device), return_dict=True
            )
        embeds = out.pooler_output
        deep = getattr(out, "deepstack_features", None) or []
        return [(e.to(self.dtype), tuple(f[i].to(self.dtype) for f in deep)) for i, e in enumerate(embeds)]

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [M, head_dim] of positions [3, M] in ``like``'s dtype: M-RoPE triples, or row
        0 for 1-D RoPE. The model's rotary module's values (each angle one float32 product, its
        frequencies' position rows picked per style) in a few ops instead of its thirty."""
        angles = positions.to(self.device).index_select(0, self._freq_axes).float()  # [half, M]: each one's row
        angles = angles.t() * self.inv_freq  # [M, half]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def rope_signed(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rope` with rotate_half's sign folded into sin (its first half negated):
        rotate_half(x) * sin == swap_halves(x) * signed sin, exactly (a sign flip commutes with *)."""
        cos, sin = self.rope(positions, like)
        return cos, sin * self._sin_sign.to(like.dtype)

    def _project(self, l: int, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        """q [m, heads, d], k and v [m, kv_heads, d] of layer ``l`` for normed inputs ``x``;
        ``sin_signed`` is the rows' sin with rotate_half's sign folded in (:meth:`rope`)."""
        attn = self.layers[l].self_attn
        m = x.shape[0]
        w, b = self._qkv[l]
        qkv = linear(x, w, b)
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, nq + nk:].view(m, self.num_kv_heads, self.head_dim)
        if self.family.qk_norm:
            q = attn.q_norm(qkv[:, :nq].view(m, self.num_heads, self.head_dim))
            k = attn.k_norm(qkv[:, nq: nq + nk].view(m, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : nq + nk].view(m, heads, self.head_dim)
        # q and k rotated together (one set of kernels for both): x * cos + rotate_half(x) * sin,
        # with rotate_half's sign folded into sin_signed (exact: a sign flip commutes with *).
        half = self.head_dim // 2
        rotated = qk * cos[:, None, :] + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin_signed[:, None, :]
        return rotated[:, : self.num_heads], rotated[:, self.num_heads:], v

    def _norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.fused_norms:
            return ops.rms_norm(x, norm.weight, norm.variance_epsilon)
        return norm(x)

    def _attention_inputs(self, l: int, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
        """Layer ``l``'s rotated queries of normed rows ``x``; their keys and values written to
        ``slots`` of the layer's caches (one kernel after the projection, where it applies)."""
        k_cache, v_cache = self._layer_caches[l]
        if self.fused_rope:
            w, b = self._qkv[l]
            return ops.rope_qkv_write(linear(x, w, b), cos, sin_signed, self.num_heads, self.num_kv_heads,
                                      k_cache, v_cache, slots)
        q, k, v = self._project(l, x, cos, sin_signed)
        ops.paged_write(k, v, k_cache, v_cache, slots)
        return q

    def _mlp(self, l: int, x: torch.Tensor) -> torch.Tensor:
        mlp = self.layers[l].mlp
        fused = self._gate_up[l]
        if fused is None:  # MoE: the model's own block (router, experts)
            return mlp(x[None])[0]
        if x.shape[0] > _MLP_ROWS and x.device.type == "cpu":  # in row chunks, so the intermediates stay in cache
            return torch.cat([self._mlp(l, part) for part in x.split(_MLP_ROWS)])
        gate, up = linear(x, *fused).chunk(2, dim=-1)
        return linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    @torch.no_grad()
    def layer0_queries(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer-0 queries [m, heads, head_dim] of tokens with these inputs (for relevance scores)."""
        cos, sin = self.rope_signed(positions, embeds)
        q, _, _ = self._project(0, self._norm(self.layers[0].input_layernorm, embeds), cos, sin)
        return q

    # ---- the layer loop ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run every layer over the batch's rows; returns float32 logits [num_seqs, vocab] of each
        sequence's last row."""
        h = batch.embeds.to(self.device, self.dtype).clone()
        cos_all, sin_all = self.rope_signed(batch.positions, h)
        batch.captured = [None] * len(batch.captures)
        for l, layer in enumerate(self.layers):
            for hook in batch.before_layer:  # KV loading from a lower tier: wait for this layer's
                hook(l)
            for i, capture in enumerate(batch.captures):
                if capture is not None and capture[0] == l:
                    batch.captured[i] = h.index_select(0, capture[1]).clone()
            for layer_at, rows_at, hidden in batch.injects:
                if layer_at == l:
                    h.index_copy_(0, rows_at, hidden.to(h.device, h.dtype))
            sub = batch.layers[l] or batch.all_rows
            rows = None if batch.layers[l] is None else sub.index
            if rows is None:
                x, cos, sin = h, cos_all, sin_all
            else:
                x, cos, sin = h.index_select(0, rows), cos_all.index_select(0, rows), sin_all.index_select(0, rows)
            attn = layer.self_attn
            normed = self._norm(layer.input_layernorm, x)
            k_cache, v_cache = self._layer_caches[l]
            if batch.select_jobs:  # a repair method picks the later layers' rows from this layer's keys
                q, k, v = self._project(l, normed, cos, sin)

                def fresh(job, k=k, rows=rows):
                    return k.index_select(0, job.rows if rows is None else torch.searchsorted(rows, job.rows))

                # The cached keys are read before this layer's write overwrites them.
                batch.select(l, fresh, lambda job, l=l: self.layer_keys(l, job.slots))
                ops.paged_write(k, v, k_cache, v_cache, sub.slots)
            else:
                q = self._attention_inputs(l, normed, cos, sin, sub.slots)
            out, _ = ops.sparse_attention(q, sub.meta, k_cache, v_cache, scale=float(attn.scaling),
                                          window=self.windows[l])
            attended = linear(out.reshape(x.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
            if self.fused_norms:  # x += attended, normed in the same pass (x is this step's own: h or a gather)
                norm = layer.post_attention_layernorm
                normed = ops.add_rms_norm(x, attended, norm.weight, norm.variance_epsilon)
            else:
                x = x + attended
                normed = layer.post_attention_layernorm(x)
            stage = [job for job in batch.compress_jobs if l in job.settings.layers]
            # The stage's scores: the router logits of this layer (computed again for the image rows only).
            logits = [self.router_logits(l, normed.index_select(0, job.rows if rows is None else
                                                               torch.searchsorted(rows, job.rows)))
                      for job in stage]
            x = x + self._mlp(l, normed)
            if batch.deepstack_features is not None and l < len(batch.deepstack_features) and sub.deepstack_visual.numel():
                x = x.index_add(0, sub.deepstack_visual, batch.deepstack_features[l].index_select(0, sub.deepstack_index))
            if rows is None:
                h = x
            else:
                h.index_copy_(0, rows, x)
            if stage:
                for job, job_logits in zip(stage, logits):
                    self._merge(l, batch, job, job_logits, h)
                batch.replan(l + 1)
            for replay in batch.replays:
                if replay.layer == l:
                    self._replay(batch, replay, h)
        last = self._norm(self.text.norm, h.index_select(0, batch.logit_rows))
        return linear(last, self.lm_head.weight, self.lm_head.bias).float()

    def router_logits(self, l: int, normed: torch.Tensor) -> torch.Tensor:
        """Router logits [m, experts] of MoE layer ``l`` for post-attention-normed rows."""
        gate = getattr(self.layers[l].mlp, "gate", None)
        if gate is None or not hasattr(gate, "weight"):
            raise UnsupportedModel(f"layer {l} has no MoE router: visual-token compression scores tokens with "
                                   "router logits")
        return linear(normed, gate.weight, None)

    def _merge(self, l: int, batch: StepBatch, job, logits: torch.Tensor, h: torch.Tensor) -> None:
        """A compression stage at layer ``l`` for one image: anchors and merge plan from the router
        logits, the merge (:meth:`_merge_rows`), the other tokens gone from layer ``l + 1`` on."""
        from samcache.compression import RouterScores, anchor_count, plan_stage

        keep = job.settings.keep_at(l)
        if anchor_count(job.positions.size, keep) == job.positions.size:
            return  # every token an anchor: nothing merges (keep 1.0 computes exactly what no compression does)
        plan = plan_stage(RouterScores.from_logits(logits.float().cpu()), job.coords, keep,
                          spread=job.settings.spread)
        kept = self._merge_rows(batch, h, l, job.rows, plan.target.to(h.device), plan.weight.to(h.device)).cpu()
        keep_mask = np.zeros(job.positions.size, dtype=bool)
        keep_mask[kept.numpy()] = True
        job.compaction.merges.append((l, job.positions, job.positions[plan.target.numpy()],
                                      plan.weight.numpy().astype(np.float32)))
        self._compact(job, l + 1, job.positions[~keep_mask])
        job.rows, job.positions, job.coords = job.rows[kept.to(job.rows.device)], job.positions[keep_mask], job.coords[kept]

    def _replay(self, batch: StepBatch, replay, h: torch.Tensor) -> None:
        """A compressed record's stage, replayed for its recomputed tokens: each recomputed anchor
        becomes its group's weighted mean by the merge stored with the record (its group was
        recomputed up to here)."""
        self._merge_rows(batch, h, replay.layer, replay.rows, replay.target, replay.weight)

    @staticmethod
    def _merge_rows(batch: StepBatch, h: torch.Tensor, layer: int, rows: torch.Tensor, target: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
        """Merge step rows ``rows`` into their anchors (``target`` indexes into ``rows``) by
        weighted average (``token_merge``): the hidden states in ``h`` and the DeepStack features
        of the layers after ``layer``. Returns the anchors' indices into ``rows``."""
        merged, kept = ops.token_merge(h.index_select(0, rows), target, weight)
        h.index_copy_(0, rows.index_select(0, kept), merged)
        if batch.deepstack_features is not None and batch.deepstack_rows is not None:
            feature_rows = torch.from_numpy(batch.deepstack_rows[rows.cpu().numpy()]).to(h.device)
            for later in range(layer + 1, len(batch.deepstack_features)):
                features = batch.deepstack_features[later]
                got, _ = ops.token_merge(features.index_select(0, feature_rows), target, weight)
                features.index_copy_(0, feature_rows.index_select(0, kept), got)
        return kept

    def _compact(self, job, first_layer: int, removed: np.ndarray) -> None:
        """Remove ``removed`` from the sequence's layers ``first_layer`` on, moving the KV those
        layers already hold after them (spliced images, an earlier record) to the new compacted
        slots; rows this step still computes there are written at their new slots anyway."""
        compaction = job.compaction
        after = job.prior[job.prior > removed.min()]
        if not after.size:  # nothing written before this step lies after them
            compaction.remove(first_layer, removed)
            return
        layers = range(first_layer, self.num_layers)
        held = {layer: compaction.kept(layer, after) for layer in layers}
        old = {layer: compaction.slots(layer, held[layer]) for layer in layers}
        compaction.remove(first_layer, removed)
        src, dst = [], []
        for layer in layers:
            stay = ~np.isin(held[layer], removed)
            new = compaction.slots(layer, held[layer][stay])
            moved = new != old[layer][stay]
            if moved.any():
                src.append(self.flat_rows(layer, slot_ids(job.block_table, old[layer][stay][moved], self.block_size)))
                dst.append(self.flat_rows(layer, slot_ids(job.block_table, new[moved], self.block_size)))
        if src:
            self.copy_rows(np.concatenate(src), np.concatenate(dst))  # gathered first: overlaps are safe

    # ---- the paged caches of all layers ---------------------------------------------------------
    def slot_tensor(self, block_table: np.ndarray, index: np.ndarray) -> torch.Tensor:
        """KV slot ids of sequence positions ``index`` (``block_pool.slot_ids``) as an int64
        tensor on the caches' device."""
        return torch.from_numpy(slot_ids(block_table, index, self.block_size)).to(self.device)

    def copy_on_write(self, copies: np.ndarray) -> None:
        """Perform the pool's (src, dst) block copies in every layer's K and V cache."""
        if not copies.size:
            return
        pairs = torch.from_numpy(copies.astype(np.int64))
        offsets = (torch.arange(self.num_layers) * self.num_blocks)[:, None, None]  # layer l's blocks in the flat view
        flat = [c.view(-1, *c.shape[2:]) for c in (self.k_cache, self.v_cache)]
        ops.copy_blocks(flat, (pairs[None] + offsets).reshape(-1, 2))

    def _all_layers(self, slots: torch.Tensor, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Slots of every layer (or of ``layers``) in the flat [layers * blocks * block_size] view,
        layer-major."""
        per_layer = self.num_blocks * self.block_size
        which = torch.arange(self.num_layers) if layers is None else torch.as_tensor(list(layers), dtype=torch.int64)
        return (slots[None, :] + which.to(self.device)[:, None] * per_layer).reshape(-1)

    def gather_kv(self, slots: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, len(slots), kv_heads, head_dim] at these slots."""
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        shape = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        return self.k_cache.view(shape)[:, slots], self.v_cache.view(shape)[:, slots]

    def read_kv(self, slots: np.ndarray | torch.Tensor) -> torch.Tensor:
        """K and V of every layer at these slots, [layers, 2, len(slots), kv_heads, head_dim]."""
        k, v = self.gather_kv(slots)
        return torch.stack([k, v], dim=1)

    def write_kv(self, slots: np.ndarray | torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ([layers, 2, len(slots), kv_heads, head_dim], any dtype or device) into
        these slots of every layer (keys as they are: already rotated to their positions)."""
        slots = torch.as_tensor(np.asarray(slots, dtype=np.int64) if isinstance(slots, np.ndarray) else slots,
                                dtype=torch.int64, device=self.device)
        shape = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        if kv.shape != (self.num_layers, 2, len(slots), self.num_kv_heads, self.head_dim):
            raise ValueError(f"kv must be {(self.num_layers, 2, len(slots), self.num_kv_heads, self.head_dim)}, "
                             f"got {tuple(kv.shape)}")
        kv = kv.to(device=self.device, dtype=self.k_cache.dtype, non_blocking=True)
        self.k_cache.view(shape)[:, slots] = kv[:, 0]
        self.v_cache.view(shape)[:, slots] = kv[:, 1]

    def layer_keys(self, layer: int, slots: np.ndarray | torch.Tensor) -> torch.Tensor:
        """K [len(slots), kv_heads, head_dim] of one layer at these slots."""
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        return self.k_cache[layer].view(-1, self.num_kv_heads, self.head_dim)[slots]

    def flat_rows(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """Rows of layer ``layer``'s ``slots`` in the flat [layers * blocks * block_size] view."""
        return np.asarray(slots, dtype=np.int64) + layer * self.num_blocks * self.block_size

    def copy_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy K and V at flat rows ``src`` to flat rows ``dst`` (any layers: packed records)."""
        src_t = torch.as_tensor(np.asarray(src, dtype=np.int64), device=self.device)
        dst_t = torch.as_tensor(np.asarray(dst, dtype=np.int64), device=self.device)
        for cache in (self.k_cache, self.v_cache):
            flat = cache.view(-1, self.num_kv_heads, self.head_dim)
            flat.index_copy_(0, dst_t, flat.index_select(0, src_t))

    def splice(self, src_slots: np.ndarray, dst_slots: np.ndarray, deltas: np.ndarray,
               layers: Sequence[int] | None = None) -> None:
        """Copy the KV at ``src_slots`` to ``dst_slots`` in every layer (or in ``layers``), each
        key re-rotated by its ``deltas`` entry of M-RoPE positions (all three axes), in one fused
        call for all those layers. ``src_slots`` may be ``dst_slots`` (re-rotation in place)."""
        n = len(src_slots)
        if not n:
            return
        count = self.num_layers if layers is None else len(layers)
        src = self._all_layers(torch.as_tensor(src_slots, dtype=torch.int64, device=self.device), layers)
        dst = self._all_layers(torch.as_tensor(dst_slots, dtype=torch.int64, device=self.device), layers)
        self.splice_flat(src, dst, torch.as_tensor(np.asarray(deltas, dtype=np.int64), device=self.device).repeat(count))

    def splice_flat(self, src: np.ndarray | torch.Tensor, dst: np.ndarray | torch.Tensor,
                    deltas: np.ndarray | torch.Tensor) -> None:
        """:meth:`splice` with explicit flat rows (layer-major view): row ``src[i]`` goes to
        ``dst[i]`` (both in the same layer's terms: the key rotation does not depend on the layer),
        its key re-rotated by ``deltas[i]``."""
        src = torch.as_tensor(np.asarray(src, dtype=np.int64) if isinstance(src, np.ndarray) else src,
                              dtype=torch.int64, device=self.device)
        dst = torch.as_tensor(np.asarray(dst, dtype=np.int64) if isinstance(dst, np.ndarray) else dst,
                              dtype=torch.int64, device=self.device)
        if not src.numel():
            return
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = self.k_cache.view(shape).index_select(0, src)  # a copy: the op refuses views of its cache
        per_row = torch.as_tensor(np.asarray(deltas, dtype=np.int64) if isinstance(deltas, np.ndarray) else deltas,
                                  dtype=torch.int64, device=self.device)
        # The same shift on all three M-RoPE axes; 1-D RoPE takes it as it is.
        deltas = per_row.expand(3, -1).contiguous() if self.family.mrope else per_row.contiguous()
        flat_k = self.k_cache.view(self.num_layers * self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        ops.rope_rerotate_write(keys, deltas, self.inv_freq, self.family.rope_style, self.mrope_section, flat_k, dst)
        values = self.v_cache.view(shape)
        values.index_copy_(0, dst, values.index_select(0, src))


__all__ = ["ModelRunner"]
