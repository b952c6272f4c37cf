"""vLLM's Qwen2.5-VL with samcache's reuse: the model class the plugin registers in its place.

Without a samcache step (the plugin off, a decode-only step, nothing reused) ``forward`` is
vLLM's own. With one, the decoder layers run on the rows each layer computes
(:class:`~.step.ForwardStep`): new tokens plus that layer's recompute rows, and the side rows
computing an isolated model's first-seen images (:mod:`samcache.integrations.isolated_rows`). The hidden states of
skipped rows are never read: vLLM samples only each request's last scheduled token, which the
plan always computes. The processor names images by samcache content keys (:mod:`.identity`);
with the plugin on, the vision tower's long attention runs on samcache's kernel (:mod:`.vision`).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.qwen2_5_vl import (Qwen2_5_VLDummyInputsBuilder, Qwen2_5_VLForConditionalGeneration,
                                                   Qwen2_5_VLMultiModalProcessor, Qwen2_5_VLProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY

from samcache.integrations.vllm import sparse_context
from samcache.integrations.vllm.config import CONNECTOR_NAME
from samcache.integrations.vllm.connector import active_worker
from samcache.integrations.vllm.identity import make_processor_class
from samcache.integrations.vllm.step import ForwardStep
from samcache.integrations.vllm.vision import use_samcache_vision_attention


def run_rows(language_model: torch.nn.Module, step: ForwardStep, positions: torch.Tensor,
             inputs_embeds: torch.Tensor) -> torch.Tensor:
    """vLLM's Qwen2Model forward over ``step``'s rows, its side rows after them at every layer (an
    isolated model's first-seen images); skipped rows of the result are zero."""
    rows, side = step.rows, step.side
    hidden = inputs_embeds.index_select(0, rows[0])
    pos = positions.index_select(1, rows[0])
    if side is not None:
        hidden = torch.cat([hidden, side.embeddings(inputs_embeds, language_model.embed_input_ids)])
        side_pos = side.positions.to(pos.device)
        pos = torch.cat([pos, side_pos], dim=1)
    residual = None
    for layer_index, layer in enumerate(language_model.layers):
        select = step.select[layer_index]
        if select is not None:  # this layer computes fewer rows than the one before
            if side is not None:  # the side rows stay, after the step's
                before = rows[layer_index - 1].numel()
                select = torch.cat([select, torch.arange(before, before + side.size)])
            hidden, residual = hidden.index_select(0, select), residual.index_select(0, select)
            pos = positions.index_select(1, rows[layer_index])
            if side is not None:
                pos = torch.cat([pos, side_pos], dim=1)
        hidden, residual = layer(pos, hidden, residual)
    hidden, _ = language_model.norm(hidden, residual)
    out = hidden.new_zeros((inputs_embeds.size(0), hidden.size(-1)))
    out.index_copy_(0, rows[-1], hidden[:rows[-1].numel()])
    return out


@MULTIMODAL_REGISTRY.register_processor(make_processor_class(Qwen2_5_VLMultiModalProcessor),
                                        info=Qwen2_5_VLProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder)
class SamcacheQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        kv = vllm_config.kv_transfer_config
        if kv is not None and kv.kv_connector == CONNECTOR_NAME and getattr(self, "visual", None) is not None:
            use_samcache_vision_attention(self.visual)  # the plugin on: samcache's kernel for long ViT attention

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        worker = active_worker()
        if worker is None or intermediate_tensors is not None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        step = worker.begin_forward(self, positions)
        if step is None or not step.sparse:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        language_model = self.language_model.model
        if inputs_embeds is None:
            inputs_embeds = language_model.embed_input_ids(input_ids)
        with sparse_context.active(step, worker):
            return run_rows(language_model, step, positions, inputs_embeds)
