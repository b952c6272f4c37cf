"""Proves tests/sglang_plugin/sglang_harness.py drives SGLang's real classes.

Run: .venv-sglang/bin/python -m pytest -q tests/sglang_plugin/test_sglang_harness.py
"""

import os
import sys

import pytest

pytest.importorskip("sglang")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import sglang_harness as H  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def env():
    H.setup_sglang()
    cfg = H.tiny_qwen2_5_vl_config()
    model = H.build_qwen2_5_vl(cfg, seed=0)
    return cfg, model


@pytest.fixture
def pools(env):
    H.reset_mm_embedding_cache()
    return H.Pools.for_model(env[1], num_slots=1024, max_reqs=8, max_context_len=256)


def _prompt(cfg, seed=0, grid=(1, 8, 8), pre=(1, 2, 3), post=(4, 5, 6, 7, 8)):
    return H.prompt_with_images(cfg, [list(pre), grid, list(post)], seed=seed)


def test_real_sglang_classes(env, pools):
    _, model = env
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    assert type(model) is Qwen2_5_VLForConditionalGeneration
    assert type(pools.req_to_token_pool) is ReqToTokenPool
    assert type(pools.token_to_kv_pool) is MHATokenToKVPool
    assert type(pools.attn_backend) is TorchNativeAttnBackend
    assert sum(isinstance(m, RadixAttention) for m in model.modules()) == 2


def test_extend_with_image_is_finite_and_writes_kv(env, pools):
    cfg, model = env
    ids, items = _prompt(cfg)
    assert len(ids) == 3 + 1 + 16 + 1 + 5
    req = H.Request.create(model, pools, ids, items)
    # the scheduler-side padding replaced the 16 image tokens by the item's pad sentinels
    assert req.padded_ids[4:20] == req.mm_inputs.mm_items[0].padding_sequence(16)
    assert req.padded_ids[:4] == ids[:4] and req.padded_ids[20:] == ids[20:]
    out = H.run_batch(model, pools, [req.extend()])
    assert out.next_token_logits.shape == (1, cfg.text_config.vocab_size)
    assert torch.isfinite(out.next_token_logits).all()
    assert out.logits.shape == (len(ids), cfg.text_config.vocab_size)
    torch.testing.assert_close(out.logits[-1], out.next_token_logits[0], atol=1e-5, rtol=0)
    # KV for the request's tokens landed in the slots named by req_to_token
    slots = pools.req_to_token[req.row, : len(ids)].long()
    k = pools.token_to_kv_pool.get_key_buffer(0)[slots]
    assert torch.isfinite(k).all() and k.abs().sum() > 0
    # the image changes the output (the ViT path is live)
    ids2, items2 = _prompt(cfg, seed=123)
    req2 = H.Request.create(model, pools, ids2, items2)
    out2 = H.run_batch(model, pools, [req2.extend()])
    assert (out2.next_token_logits - out.next_token_logits).abs().max() > 1e-3


@pytest.mark.parametrize("split", [21, 10], ids=["after_image", "inside_image"])
def test_prefix_then_extend_then_decode_matches_whole(env, pools, split):
    cfg, model = env
    ids, items = _prompt(cfg)
    whole = H.Request.create(model, pools, ids, items)
    full = H.run_batch(model, pools, [whole.extend()])
    dec_whole = H.run_batch(model, pools, [whole.decode(42)], mode="decode")

    H.reset_mm_embedding_cache()  # make the pieces re-encode the image themselves
    ids_b, items_b = _prompt(cfg)
    pieces = H.Request.create(model, pools, ids_b, items_b)
    first = H.run_batch(model, pools, [pieces.extend(split)])
    second = H.run_batch(model, pools, [pieces.extend()])
    assert pieces.kv_len == len(ids)
    dec_pieces = H.run_batch(model, pools, [pieces.decode(42)], mode="decode")

    torch.testing.assert_close(
        torch.cat([first.logits, second.logits]), full.logits, atol=ATOL, rtol=0
    )
    torch.testing.assert_close(second.next_token_logits, full.next_token_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(dec_pieces.next_token_logits, dec_whole.next_token_logits, atol=ATOL, rtol=0)


def test_batch_of_two_matches_each_alone(env, pools):
    cfg, model = env
    prompts = [
        _prompt(cfg, seed=1),
        _prompt(cfg, seed=2, grid=(1, 4, 8), pre=(9, 8), post=(7, 6, 5, 4, 3, 2, 1)),
    ]
    alone, alone_dec = [], []
    for ids, items in prompts:
        r = H.Request.create(model, pools, ids, items)
        alone.append(H.run_batch(model, pools, [r.extend()]))
        alone_dec.append(H.run_batch(model, pools, [r.decode(7)], mode="decode"))

    H.reset_mm_embedding_cache()
    reqs = [H.Request.create(model, pools, ids, items) for ids, items in prompts]
    both = H.run_batch(model, pools, [r.extend() for r in reqs])
    both_dec = H.run_batch(model, pools, [r.decode(7) for r in reqs], mode="decode")
    for i in range(2):
        torch.testing.assert_close(both.next_token_logits[i], alone[i].next_token_logits[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(both.request_logits(i), alone[i].logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(both_dec.next_token_logits[i], alone_dec[i].next_token_logits[0], atol=ATOL, rtol=0)


def test_mixed_batch_extend_plus_decode(env, pools):
    cfg, model = env
    ids_a, items_a = _prompt(cfg, seed=3)
    ids_b, items_b = _prompt(cfg, seed=4, grid=(1, 8, 4))
    # reference: each alone
    ra = H.Request.create(model, pools, ids_a, items_a)
    H.run_batch(model, pools, [ra.extend()])
    ref_a = H.run_batch(model, pools, [ra.decode(11)], mode="decode")
    rb = H.Request.create(model, pools, ids_b, items_b)
    ref_b = H.run_batch(model, pools, [rb.extend()])
    # mixed: A decodes while B prefills
    H.reset_mm_embedding_cache()
    ma = H.Request.create(model, pools, ids_a, items_a)
    H.run_batch(model, pools, [ma.extend()])
    mb = H.Request.create(model, pools, ids_b, items_b)
    mixed = H.run_batch(model, pools, [mb.extend(), ma.decode(11)], mode="mixed")
    torch.testing.assert_close(mixed.next_token_logits[0], ref_b.next_token_logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed.next_token_logits[1], ref_a.next_token_logits[0], atol=ATOL, rtol=0)


def test_mrope_positions_follow_sglang(env):
    cfg, _ = env
    ids, items = _prompt(cfg)
    pos, delta = H.mrope_positions_for(ids, [(1, 8, 8)], cfg)
    assert pos.shape == (3, len(ids))
    # text before the image: t = h = w = index
    assert pos[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    # image tokens: 4x4 merged grid starting at 4
    img = pos[:, 4:20]
    assert img[0].unique().tolist() == [4]
    assert img[1].unique().tolist() == [4, 5, 6, 7] and img[2].unique().tolist() == [4, 5, 6, 7]
    assert int(delta) == int(pos.max()) + 1 - len(ids)


def test_matches_transformers_reference(env, pools):
    """Independent check: SGLang's model (our harness) vs transformers' model
    with the same weights on the same prompt."""
    cfg, model = env
    hf = H.hf_reference_qwen2_5_vl(cfg, seed=0)
    ids, items = _prompt(cfg, seed=5)
    req = H.Request.create(model, pools, ids, items)
    out = H.run_batch(model, pools, [req.extend()])
    input_ids = torch.tensor([ids])
    # transformers 5 only builds 3-D M-RoPE positions when told which tokens are image tokens
    mm_token_type_ids = (input_ids == cfg.image_token_id).int()
    with torch.no_grad():
        ref = hf(
            input_ids=input_ids,
            mm_token_type_ids=mm_token_type_ids,
            pixel_values=items[0].feature,
            image_grid_thw=items[0].image_grid_thw,
        ).logits[0]
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


def test_qwen3_vl_moe_runs_and_matches_transformers():
    """SGLang's Qwen3-VL-MoE (fused MoE, deepstack) on CPU: chunked prefill
    equals whole prefill, and both equal transformers with the same weights."""
    H.setup_sglang()
    H.reset_mm_embedding_cache()
    cfg = H.tiny_qwen3_vl_moe_config()
    model = H.build_qwen3_vl_moe(cfg, seed=0)
    pools = H.Pools.for_model(model, num_slots=512, max_reqs=4, max_context_len=128)
    ids, items = H.prompt_with_images(cfg, [[1, 2, 3], (1, 8, 8), [4, 5, 6, 7, 8]], seed=5)
    req = H.Request.create(model, pools, ids, items)
    out = H.run_batch(model, pools, [req.extend()])
    assert torch.isfinite(out.next_token_logits).all()

    H.reset_mm_embedding_cache()
    req2 = H.Request.create(model, pools, ids, items)
    a = H.run_batch(model, pools, [req2.extend(12)])
    b = H.run_batch(model, pools, [req2.extend()])
    torch.testing.assert_close(torch.cat([a.logits, b.logits]), out.logits, atol=ATOL, rtol=0)

    hf = H.hf_reference_qwen3_vl_moe(cfg, seed=0)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(
            input_ids=input_ids,
            mm_token_type_ids=(input_ids == cfg.image_token_id).int(),
            pixel_values=items[0].feature,
            image_grid_thw=items[0].image_grid_thw,
        ).logits[0]
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
