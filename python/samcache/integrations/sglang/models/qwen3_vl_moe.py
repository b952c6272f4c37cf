"""SGLang's Qwen3-VL-MoE with samcache's reuse (registered under the same architecture name).

As for Qwen2.5-VL (:mod:`.qwen2_5_vl`): SGLang's own forward unless a step reuses images; then the
decoder layers (attention + SGLang's fused MoE) run on each layer's rows, the deepstack features of
the vision tower added to those rows after the first layers as SGLang's inference path adds them.
Keys are re-rotated with Qwen3-VL's interleaved M-RoPE.
"""

from __future__ import annotations

from sglang.srt.managers.mm_utils import general_mm_embed_routine
from sglang.srt.models import qwen3_vl_moe as _sglang

from samcache.integrations.sglang.reuse import ReuseOverride


class Qwen3VLMoeForConditionalGeneration(ReuseOverride, _sglang.Qwen3VLMoeForConditionalGeneration):
    def forward(self, input_ids, positions, forward_batch, get_embedding=False, pp_proxy_tensors=None):
        def sglang_forward():
            return super(Qwen3VLMoeForConditionalGeneration, self).forward(
                input_ids, positions, forward_batch, get_embedding, pp_proxy_tensors)

        if get_embedding or pp_proxy_tensors is not None or self.language_model_only:
            return sglang_forward()
        return self.samcache_forward(input_ids, forward_batch, sglang_forward, general_mm_embed_routine,
                                     use_deepstack=self.use_deepstack)


EntryClass = Qwen3VLMoeForConditionalGeneration
