"""SGLang's Qwen2.5-VL with samcache's reuse (registered under the same architecture name).

Without a samcache step (no images, a decode batch, another attention backend, nothing stored and
nothing to save) ``forward`` is SGLang's own. With one, the stored images are spliced into the
request's KV slots re-rotated to their new ``mrope_positions``, and the decoder layers run on the
rows each layer computes (:mod:`samcache.integrations.sglang.reuse`); the vision tower, the
embedding routine (with SGLang's own ViT-output cache) and the logits processor are SGLang's.
"""

from __future__ import annotations

from sglang.srt.managers.mm_utils import general_mm_embed_routine
from sglang.srt.models import qwen2_5_vl as _sglang

from samcache.integrations.sglang.reuse import ReuseOverride


class Qwen2_5_VLForConditionalGeneration(ReuseOverride, _sglang.Qwen2_5_VLForConditionalGeneration):
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None):
        def sglang_forward():
            return super(Qwen2_5_VLForConditionalGeneration, self).forward(
                input_ids, positions, forward_batch, input_embeds, get_embedding, pp_proxy_tensors)

        if get_embedding or input_embeds is not None or pp_proxy_tensors is not None:
            return sglang_forward()
        return self.samcache_forward(input_ids, forward_batch, sglang_forward, general_mm_embed_routine)


EntryClass = Qwen2_5_VLForConditionalGeneration
