"""The model runner: Hugging Face weights, samcache's paged KV and its own layer loop.

transformers' modules provide the weights and the per-token math (norms, projections, MLP / MoE
experts, the vision tower); the runner owns the loop over layers, so it decides which tokens are
computed at each layer. A forward step computes rows ``index`` (sequence positions) of one
sequence: at layer ``l`` only ``layer_rows[l]`` of them (nested, shrinking with depth: the
tokens recomputed there plus every new token). Their K/V go into the sequence's slots of the
layer's paged cache, and their queries attend to the whole sequence through
``torch.ops.samcache.sparse_attention``; every other position keeps the KV already in the pool
(an adopted prefix, or an image's KV spliced in at its new positions).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np
import torch

from samcache import ops
from samcache.engine.family import Family
from samcache.errors import UnsupportedModel


@dataclass
class ForwardBatch:
    """Rows to compute in one forward step of one sequence (see the module docstring)."""

    index: torch.Tensor  # int64 [M], ascending sequence positions; the last is the sequence's last token
    embeds: torch.Tensor  # [M, hidden] layer-0 inputs
    positions: torch.Tensor  # int64 [3, M] M-RoPE positions
    slots: torch.Tensor  # int64 [M] KV slots
    block_table: torch.Tensor  # int32 [blocks] of the sequence
    num_kv_tokens: int  # tokens of the sequence with KV after this step
    layer_rows: list[torch.Tensor | None] | None = None  # per layer, rows into M (None: all rows)
    deepstack_rows: torch.Tensor | None = None  # int64 [M]: row of the DeepStack features, -1 for text
    deepstack_features: list[torch.Tensor] | None = None  # per DeepStack layer [visual rows, hidden]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelRunner:
    """Loads a checkpoint of ``family`` and runs forward steps over a paged KV cache of
    ``num_blocks`` x ``block_size`` tokens per layer."""

    def __init__(self, model_path: str | pathlib.Path, family: Family, *, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int | None = None,
                 kv_cache_bytes: int = 256 << 20, model=None) -> None:
        import transformers

        self.family = family
        self.device = device
        self.dtype = dtype
        if model is None:
            model = getattr(transformers, family.model_class).from_pretrained(str(model_path), dtype=dtype)
            model.to(device).eval().requires_grad_(False)
        elif type(model).__name__ != family.model_class or next(model.parameters()).dtype != dtype:
            raise ValueError(f"a shared model must be a {family.model_class} in {dtype}")
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
                "re-rotating cached keys assumes plain M-RoPE"
            )
        self.inv_freq = rotary.inv_freq.detach().float().to(device)
        self.mrope_section = [int(s) for s in rotary.mrope_section]
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        self.windows = [int(cfg.sliding_window) if t == "sliding_attention" else -1 for t in layer_types]
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = max(1, kv_cache_bytes // (self.kv_bytes_per_token * block_size))
        self.num_blocks = num_blocks
        shape = (self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # One tensor per K/V for all layers: layer l's cache is the contiguous view [l], and an image's
        # KV for every layer is spliced in with one fused re-rotate-and-write call.
        # Uninitialised: attention reads only slots a sequence has written (its first num_kv_tokens).
        self.k_cache = torch.empty(shape, dtype=dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=device)
        self.visual = model.model.visual
        self.deepstack_layers = len(getattr(self.config.vision_config, "deepstack_visual_indexes", []) or [])

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    # ---- inputs --------------------------------------------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(token_ids.to(self.device))

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[torch.Tensor, tuple]]:
        """ViT outputs per image: (embeds [tokens, hidden], DeepStack features per layer or ())."""
        out = self.model.model.get_image_features(
            pixel_values.to(self.device, self.dtype), grid_thw.to(self.device), return_dict=True
        )
        embeds = out.pooler_output
        deep = getattr(out, "deepstack_features", None) or []
        return [(e.to(self.dtype), tuple(f[i].to(self.dtype) for f in deep)) for i, e in enumerate(embeds)]

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [M, head_dim] of M-RoPE positions [3, M] (the model's own rotary module)."""
        cos, sin = self.text.rotary_emb(like, positions.to(self.device)[:, None, :])
        return cos[0], sin[0]

    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn = layer.self_attn
        m = x.shape[0]
        q = attn.q_proj(x).view(m, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(m, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(m, self.num_kv_heads, self.head_dim)
        if self.family.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v

    @torch.no_grad()
    def layer0_queries(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer-0 queries [m, heads, head_dim] of tokens with these inputs (for relevance scores)."""
        cos, sin = self.rope(positions, embeds)
        layer = self.layers[0]
        q, _, _ = self._qkv(layer, layer.input_layernorm(embeds), cos, sin)
        return q

    # ---- the layer loop ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run every layer over the batch's rows; returns float32 logits [vocab] of its last row."""
        h = batch.embeds.to(self.dtype).clone()
        cos_all, sin_all = self.rope(batch.positions, h)
        slots_all = batch.slots.to(self.device)
        index_all = batch.index.to(self.device)
        table = batch.block_table.to(self.device)
        rows_per_layer = batch.layer_rows or [None] * self.num_layers
        for l, layer in enumerate(self.layers):
            rows = rows_per_layer[l]
            if rows is None:
                x, cos, sin, slots, index = h, cos_all, sin_all, slots_all, index_all
            else:
                rows = rows.to(self.device)
                x, cos, sin = h.index_select(0, rows), cos_all.index_select(0, rows), sin_all.index_select(0, rows)
                slots, index = slots_all.index_select(0, rows), index_all.index_select(0, rows)
            attn = layer.self_attn
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            ops.paged_write(k, v, self.k_cache[l], self.v_cache[l], slots)
            out, _ = ops.sparse_attention(
                q.contiguous(), index, self.k_cache[l], self.v_cache[l], table, batch.num_kv_tokens,
                scale=float(attn.scaling), window=self.windows[l],
            )
            x = x + attn.o_proj(out.reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x)[None])[0]
            if batch.deepstack_features is not None and l < len(batch.deepstack_features):
                feat_rows = batch.deepstack_rows if rows is None else batch.deepstack_rows.index_select(0, rows.cpu())
                visual = torch.nonzero(feat_rows >= 0).flatten()
                if visual.numel():
                    x = x.clone()
                    x[visual.to(self.device)] += batch.deepstack_features[l][feat_rows[visual].to(self.device)]
            if rows is None:
                h = x
            else:
                h.index_copy_(0, rows, x)
        last = self.text.norm(h[-1:])
        return self.lm_head(last)[0].float()

    # ---- the paged caches of all layers ---------------------------------------------------------
    def slots_for(self, block_table: np.ndarray, index: np.ndarray) -> np.ndarray:
        """KV slot ids of sequence positions ``index`` for a sequence with ``block_table``."""
        index = np.asarray(index, dtype=np.int64)
        return block_table.astype(np.int64)[index // self.block_size] * self.block_size + index % self.block_size

    def slot_tensor(self, block_table: np.ndarray, index: np.ndarray) -> torch.Tensor:
        """``slots_for`` as an int64 tensor on the caches' device."""
        return torch.from_numpy(self.slots_for(block_table, index)).to(self.device)

    def copy_on_write(self, copies: np.ndarray) -> None:
        """Perform the pool's (src, dst) block copies in every layer's K and V cache."""
        if not copies.size:
            return
        pairs = torch.from_numpy(copies.astype(np.int64))
        offsets = (torch.arange(self.num_layers) * self.num_blocks)[:, None, None]  # layer l's blocks in the flat view
        flat = [c.view(-1, *c.shape[2:]) for c in (self.k_cache, self.v_cache)]
        ops.copy_blocks(flat, (pairs[None] + offsets).reshape(-1, 2))

    def gather_kv(self, block_table: np.ndarray, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, len(index), kv_heads, head_dim] of sequence positions ``index``."""
        slots = self.slot_tensor(block_table, index)
        shape = (self.num_layers, -1, self.num_kv_heads, self.head_dim)
        return self.k_cache.view(shape)[:, slots], self.v_cache.view(shape)[:, slots]

    def layer_keys(self, layer: int, block_table: np.ndarray, index: np.ndarray) -> torch.Tensor:
        """K [len(index), kv_heads, head_dim] of one layer at sequence positions ``index``."""
        return self.k_cache[layer].view(-1, self.num_kv_heads, self.head_dim)[self.slot_tensor(block_table, index)]

    def splice(self, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, block_table: np.ndarray,
               index: np.ndarray) -> None:
        """Write cached K/V [layers, n, kv_heads, head_dim] into sequence positions ``index`` of
        every layer in one fused call, the keys re-rotated by M-RoPE ``delta`` [3, n]."""
        n = len(index)
        per_layer = self.num_blocks * self.block_size
        slots = (self.slot_tensor(block_table, index)[None, :]
                 + torch.arange(self.num_layers, device=self.device)[:, None] * per_layer).reshape(-1)
        flat_k = self.k_cache.view(self.num_layers * self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        ops.rope_rerotate_write(k.reshape(self.num_layers * n, self.num_kv_heads, self.head_dim),
                                delta.repeat(1, self.num_layers).to(self.device), self.inv_freq,
                                self.family.rope_style, self.mrope_section, flat_k, slots)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
            0, slots, v.reshape(self.num_layers * n, self.num_kv_heads, self.head_dim))


__all__ = ["ForwardBatch", "ModelRunner"]
