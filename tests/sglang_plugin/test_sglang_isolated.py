"""samcache's SGLang Qwen2.5-VL override serving a model whose images attend in isolation: first-seen
images computed alone in side rows, known ones spliced exactly at new indices. The reference is
the Hugging Face model with the same weights and explicit per-layer 4-D masks
(:func:`samcache.tasks.image_isolation.forward_logits`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import sglang_harness as H
from samcache.integrations.settings import ReuseSettings
from samcache.integrations.sglang.attention import SamcacheAttnBackend
from samcache.integrations.sglang.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Qwen25Override
from samcache.integrations.sglang.reuse import ModelReuse, reset_stats, stats
from samcache.cache.stores import TensorStore
from samcache.profile.image_attention import CONFIG_KEY, ImageAttention

pytest.importorskip("transformers")
from samcache.tasks.image_isolation import forward_logits  # noqa: E402

GRID_A, GRID_B = (1, 8, 8), (1, 8, 12)  # 16 and 24 image tokens


@pytest.fixture(autouse=True)
def fresh_vit_cache():
    H.setup_sglang()
    H.reset_mm_embedding_cache()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    H.setup_sglang()
    config = H.tiny_qwen2_5_vl_config()
    return config, H.hf_reference_qwen2_5_vl(config, seed=0)


def _declared_folder(tmp_path, attention: ImageAttention):
    """A checkpoint folder whose config.json declares ``attention`` (what ModelReuse reads)."""
    (tmp_path / "config.json").write_text(json.dumps({CONFIG_KEY: attention.to_dict()}))
    return str(tmp_path)


def _override(config, folder: str, settings=None, store=None):
    """The override loaded from ``folder`` (the harness's server names a dummy model path)."""
    model = H._build_from_hf(Qwen25Override, config, 0, H.hf_reference_qwen2_5_vl)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("samcache.integrations.sglang.reuse.model_path", lambda _: folder)
        model._samcache_reuse = ModelReuse(model, settings or ReuseSettings(),
                                           store if store is not None else TensorStore("t", 1 << 28))
    return model


def _run(model, prompt, pools=None, first_token=True):
    """One request's extend step, with the plugin's batch hook's record of the request."""
    pools = pools or H.Pools.for_model(model, backend_factory=SamcacheAttnBackend)
    ids, items = prompt
    req = H.Request.create(model, pools, ids, items)

    def hook(fb):
        fb.samcache_reqs = [SimpleNamespace(origin_input_ids=list(ids) if first_token else [])]
        return fb

    return H.run_batch(model, pools, [req.extend()], capture_full_hidden=False, after_init=hook), req, pools


def _reference(hf, config, prompt, attention: ImageAttention) -> torch.Tensor:
    ids, items = prompt
    input_ids = torch.tensor([ids])
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "pixel_values": torch.cat([it.feature for it in items]),
             "image_grid_thw": torch.cat([it.image_grid_thw for it in items]),
             "mm_token_type_ids": (input_ids == config.image_token_id).to(torch.int32)}
    with torch.no_grad():
        logits, _ = forward_logits(hf, batch, attention)
    return logits[0, -1]


def _prompts(config):
    first = H.prompt_with_images(config, [[1, 2, 3], GRID_A, [7, 8, 9], GRID_B, [10, 11, 12]], seed=0)
    # The same first token (the sink), another prefix after it.
    ids, items = H.prompt_with_images(config, [[1, 5, 6, 7, 8], GRID_B, [20, 21], GRID_A, [13, 14, 15, 16]], seed=0)
    items[0].feature, items[1].feature = first[1][1].feature.clone(), first[1][0].feature.clone()
    return first, (ids, items)


def test_isolated_images_are_computed_alone_and_reused_exactly_at_new_indices(setup, tmp_path):
    config, hf = setup
    model = _override(config, _declared_folder(tmp_path, ImageAttention("isolated")))
    reuse = model._samcache_reuse
    assert reuse.isolated is not None and reuse.budget is None and not reuse.keep_image_order
    first, second = _prompts(config)
    isolated = ImageAttention("isolated")

    reset_stats()
    got, _, _ = _run(model, first)
    s = stats()
    assert s.isolated_images == 2 and s.images_saved == 2 and s.image_kv_hits == 0 and s.isolated_fallbacks == 0
    want = _reference(hf, config, first, isolated)
    torch.testing.assert_close(got.next_token_logits[0].float(), want, atol=1e-4, rtol=0)
    # The test can fail: the same prompt computed in context gives other logits.
    assert (_reference(hf, config, first, ImageAttention()) - want).abs().max() > 1e-3

    reset_stats()
    got, req, pools = _run(model, second)  # both images at another index, after another prefix: spliced
    s = stats()
    assert s.image_kv_hits == 2 and s.isolated_images == 0 and s.image_reused_tokens == 40
    assert s.recomputed_tokens == 0 and s.computed_tokens == s.prompt_tokens - 40
    torch.testing.assert_close(got.next_token_logits[0].float(), _reference(hf, config, second, isolated),
                               atol=1e-4, rtol=0)
    step = H.run_batch(model, pools, [req.decode(int(got.next_token_logits.argmax()))], mode="decode",
                       capture_full_hidden=False)
    assert torch.isfinite(step.next_token_logits).all()


def test_a_record_made_after_another_sink_is_not_reused(setup, tmp_path):
    config, _ = setup
    store = TensorStore("shared", 1 << 28)
    model = _override(config, _declared_folder(tmp_path, ImageAttention("isolated")), store=store)
    first, _ = _prompts(config)
    _run(model, first)
    ids, items = H.prompt_with_images(config, [[9, 2, 3], GRID_A, [7, 8, 9], GRID_B, [10, 11, 12]], seed=0)
    reset_stats()
    _run(model, (ids, items))
    assert stats().image_kv_hits == 0 and stats().isolated_images == 2  # another first token: computed again


def test_without_the_prompts_first_token_images_fall_back_and_say_so(setup, tmp_path):
    config, _ = setup
    model = _override(config, _declared_folder(tmp_path, ImageAttention("isolated")))
    first, _ = _prompts(config)
    reset_stats()
    _run(model, first, first_token=False)
    s = stats()
    assert s.isolated_fallbacks == 2 and s.isolated_images == 0 and s.images_saved == 0


def test_the_top_layers_variant_and_recompute_rates_are_refused(setup, tmp_path):
    config, _ = setup
    with pytest.raises(ValueError, match="keeps its top 2 layers in context, which the plugins do not serve"):
        _override(config, _declared_folder(tmp_path, ImageAttention("isolated", context_layers=1 + 1)))
    rates = ReuseSettings(recompute_rates=(0.1,) * config.text_config.num_hidden_layers)
    with pytest.raises(ValueError, match="nothing of it is recomputed; drop recompute_rates"):
        _override(config, _declared_folder(tmp_path, ImageAttention("isolated")), settings=rates)
