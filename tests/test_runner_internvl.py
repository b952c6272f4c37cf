"""The runner on InternVL3.5's architecture (InternViT tiles, a pixel-shuffle projector, a Qwen3-MoE
language model with plain 1-D RoPE and QK-norm): its layer loop computes what transformers'
``InternVLForConditionalGeneration`` computes, keys re-rotated to another position equal the keys
computed there, and the router is read as for Qwen3-VL-MoE. (The engine's prompt and image path for
InternVL is the next step; these check the parts below it.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from samcache.engine.batch import SequenceStep, StepBatch  # noqa: E402
from samcache.families import Family  # noqa: E402
from samcache.engine.runner import ModelRunner  # noqa: E402

INTERNVL = Family("internvl", "InternVLForConditionalGeneration", "InternVLProcessor", "neox", qk_norm=True,
                  deepstack=False, vision_attr="vision_tower", vision_input="tiles")
IMAGE_TOKEN = 1040
TILE_TOKENS = 16  # (64 px / 8 px patches)^2 x 0.5^2 after the pixel shuffle


@pytest.fixture(scope="module")
def model():
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen3MoeConfig

    text = Qwen3MoeConfig(vocab_size=1088, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=32768,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[],
                          tie_word_embeddings=False)
    vision = InternVLVisionConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  image_size=64, patch_size=8)
    cfg = InternVLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=IMAGE_TOKEN,
                         image_seq_length=TILE_TOKENS, downsample_ratio=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    return InternVLForConditionalGeneration(cfg).eval().requires_grad_(False)


def _inputs(tiles: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    before = torch.randint(0, 1000, (7,), generator=g)
    after = torch.randint(0, 1000, (5,), generator=g)
    ids = torch.cat([before, torch.full((tiles * TILE_TOKENS,), IMAGE_TOKEN), after])
    pixels = torch.randn(tiles, 3, 64, 64, generator=g)
    return ids, pixels


def _step(runner, ids, embeds, positions):
    n = ids.numel()
    blocks = np.arange(-(-n // runner.block_size), dtype=np.int32)
    return SequenceStep(rows=np.arange(n), embeds=embeds, positions=positions, block_table=blocks, num_kv_tokens=n)


def test_the_runner_computes_what_transformers_computes(model):
    runner = ModelRunner(None, INTERNVL, device=torch.device("cpu"), dtype=torch.float32, block_size=16,
                         num_blocks=64, model=model)
    assert runner.mrope_section == [] and runner.visual is model.model.vision_tower
    ids, pixels = _inputs(tiles=5)  # 2x2 tiles and a thumbnail, as the processor cuts a wide image
    with torch.no_grad():
        ref = model(input_ids=ids[None], pixel_values=pixels).logits[0, -1]
    (feats, deep), = runner.encode_images(pixels, torch.tensor([5]))
    assert feats.shape == (5 * TILE_TOKENS, 128) and deep == ()
    embeds = runner.embed_tokens(ids).clone()
    embeds[ids == IMAGE_TOKEN] = feats
    positions = torch.arange(ids.numel()).expand(3, -1).contiguous()  # 1-D RoPE reads row 0
    logits = runner.forward(StepBatch.build([_step(runner, ids, embeds, positions)], num_layers=runner.num_layers,
                                            block_size=16, device=runner.device))[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    # Two images in one call: split by their tile counts.
    both = runner.encode_images(torch.cat([pixels, pixels[:1]]), torch.tensor([5, 1]))
    assert [tuple(e.shape) for e, _ in both] == [(80, 128), (16, 128)]
    torch.testing.assert_close(both[0][0], feats)
    assert runner.router_logits(1, torch.randn(3, 128)).shape == (3, 4)


def test_keys_rerotated_to_a_new_position_equal_keys_computed_there(model):
    """Layer 0's keys of an image prefilled at one position, spliced by the 1-D re-rotation to
    another, equal the keys a prefill at that position writes (no left context flows into layer 0)."""
    runner = ModelRunner(None, INTERNVL, device=torch.device("cpu"), dtype=torch.float32, block_size=16,
                         num_blocks=64, model=model)
    ids, pixels = _inputs(tiles=1, seed=1)
    (feats, _), = runner.encode_images(pixels, torch.tensor([1]))
    embeds = runner.embed_tokens(ids).clone()
    embeds[ids == IMAGE_TOKEN] = feats
    n, shift = ids.numel(), 37
    for start, first_block in ((0, 0), (shift, 8)):
        positions = (torch.arange(n) + start).expand(3, -1).contiguous()
        step = _step(runner, ids, embeds, positions)
        step.block_table = step.block_table + first_block
        runner.forward(StepBatch.build([step], num_layers=runner.num_layers, block_size=16, device=runner.device))
    k = runner.k_cache[0].reshape(-1, 2, 32)
    src = np.arange(n)  # the first prefill's slots, at positions 0..n-1
    moved = np.arange(n) + 32 * 16  # free slots far away
    runner.splice(src, moved, np.full(n, shift))
    torch.testing.assert_close(k[moved], k[np.arange(n) + 8 * 16], atol=2e-5, rtol=1e-5)
    v = runner.v_cache[0].reshape(-1, 2, 32)
    assert torch.equal(v[moved], v[src])


def test_an_internvl_checkpoint_with_another_language_model_is_refused(tiny_checkpoints, tmp_path):
    """InternVL3.5 ships dense (Qwen3) and MoE language models; the engine runs the MoE ones."""
    import json
    import shutil

    from samcache import UnsupportedModel
    from samcache.families import detect_family

    assert detect_family(tiny_checkpoints["internvl"]).name == "internvl"
    copy = tmp_path / "dense-internvl"
    shutil.copytree(tiny_checkpoints["internvl"], copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["text_config"]["model_type"] = "qwen3"
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="InternVL checkpoint with a qwen3 language model"):
        detect_family(copy)
