"""samcache.random_checkpoints: tiny random-weight Qwen-VL checkpoints built offline."""

import hashlib
import json
import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub (read at import)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import samcache.random_checkpoints as sm  # noqa: E402
from samcache.random_checkpoints import FAMILIES, build_tiny_model, load_processor, model_class  # noqa: E402

IMAGE_HW = (84, 112)  # a synthetic RGB image, height x width


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> checkpoint directory built with seed 0 and the defaults."""
    return {f: build_tiny_model(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded(built):
    """family -> (model, processor), both loaded from the directory."""
    out = {}
    for f, path in built.items():
        model, info = model_class(f).from_pretrained(path, output_loading_info=True)
        assert not any(info.values()), info  # every weight came from the file, none re-initialised
        out[f] = (model.eval(), load_processor(path))
    return out


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _chat_inputs(processor):
    rng = np.random.default_rng(0)
    image = (rng.random((*IMAGE_HW, 3)) * 255).astype(np.uint8)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this screenshot?"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    internvl = type(processor).__name__ == "InternVLProcessor"
    assert ("<IMG_CONTEXT>" if internvl else "<|vision_start|><|image_pad|><|vision_end|>") in text
    return processor(images=[image], text=[text], return_tensors="pt")


def _smart_resize(h, w, factor, min_pixels, max_pixels):
    """Qwen's resize rule, restated: both sides a multiple of factor, pixels within bounds."""
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


@pytest.mark.parametrize("family", FAMILIES)
def test_directory_holds_a_loadable_checkpoint(built, family):
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    path = built[family]
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= names
    assert sum(p.stat().st_size for p in path.iterdir()) < 8 << 20  # a few MB

    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == [sm.model_class(family).__name__]
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.text_config.eos_token_id == tok.eos_token_id == sm.SPECIAL_TOKEN_IDS["<|im_end|>"]
    if family == "internvl":
        # Qwen's tokens, then InternVL's image markup; a Qwen3-MoE language model with 1-D RoPE.
        assert len(tok) == sm.TOKENIZER_SIZE + 4 <= cfg.text_config.vocab_size
        assert cfg.image_token_id == tok.context_image_token_id == tok.convert_tokens_to_ids("<IMG_CONTEXT>") == 1040
        assert (tok.start_image_token_id, tok.end_image_token_id) == (1038, 1039)
        assert cfg.text_config.model_type == "qwen3_moe" and "mrope_section" not in cfg.text_config.rope_parameters
        assert cfg.image_seq_length == (cfg.vision_config.image_size[0] // cfg.vision_config.patch_size[0] // 2) ** 2
        proc_cfg = json.loads((path / "processor_config.json").read_text())
        assert proc_cfg["processor_class"] == "InternVLProcessor" and proc_cfg["image_processor"]["crop_to_patches"]
        return
    assert len(tok) == sm.TOKENIZER_SIZE <= cfg.text_config.vocab_size
    for key, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert getattr(cfg, key) == tok.convert_tokens_to_ids(token) == sm.SPECIAL_TOKEN_IDS[token]
    assert cfg.text_config.eos_token_id == tok.eos_token_id == sm.SPECIAL_TOKEN_IDS["<|im_end|>"]

    image_processor = AutoImageProcessor.from_pretrained(path)
    assert image_processor.patch_size == cfg.vision_config.patch_size
    assert image_processor.merge_size == cfg.vision_config.spatial_merge_size
    proc_cfg = json.loads((path / "processor_config.json").read_text())
    assert proc_cfg["processor_class"] == {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor"}[family]

    text = cfg.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert cfg.vision_config.out_hidden_size == text.hidden_size
    if family == "qwen3_vl_moe":
        assert text.rope_parameters["mrope_interleaved"] is True
        assert max(cfg.vision_config.deepstack_visual_indexes) < cfg.vision_config.depth
        assert text.num_experts > text.num_experts_per_tok >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_processor_loads_or_only_lacks_torchvision(built, family):
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    import transformers

    name = json.loads((built[family] / "processor_config.json").read_text())["processor_class"]
    processor_cls = getattr(transformers, name)
    assert isinstance(load_processor(built[family]), processor_cls)
    if is_torchvision_available():
        assert isinstance(AutoProcessor.from_pretrained(built[family]), processor_cls)
    else:
        # transformers 5 insists on a (torchvision) video processor for Qwen-VL; load_processor
        # builds the same class from the same files without one.
        with pytest.raises(ImportError, match="(?i)torchvision"):
            AutoProcessor.from_pretrained(built[family])
        with pytest.raises(ValueError, match="videos"):
            load_processor(built[family])(text=["x"], videos=[np.zeros((2, 28, 28, 3), np.uint8)])


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_and_forward_pass(loaded, family):
    model, processor = loaded[family]
    cfg = model.config
    inputs = _chat_inputs(processor)
    if family == "internvl":
        # A 112x84 image: the 2x2 tile grid closest to its aspect (max 4 tiles) plus a thumbnail,
        # 16 tokens a tile between <img> and </img>.
        assert inputs["pixel_values"].shape[0] == 5
        assert int((inputs["input_ids"] == cfg.image_token_id).sum()) == 5 * cfg.image_seq_length
    else:
        _check_qwen_grid(cfg, processor, inputs)
    with torch.no_grad():
        out = model(**inputs)
    seq = inputs["input_ids"].shape[1]
    assert out.logits.shape == (1, seq, cfg.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()

    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert seq < generated.shape[1] <= seq + 3
    assert torch.equal(generated[:, :seq], inputs["input_ids"])


def _check_qwen_grid(cfg, processor, inputs):
    assert "mm_token_type_ids" in inputs

    # The image becomes a (1, h, w) patch grid of the resized image; every 2x2 block of patches
    # is one image token.
    patch, merge = cfg.vision_config.patch_size, cfg.vision_config.spatial_merge_size
    ip = processor.image_processor
    rh, rw = _smart_resize(*IMAGE_HW, patch * merge, ip.size["shortest_edge"], ip.size["longest_edge"])
    assert inputs["image_grid_thw"].tolist() == [[1, rh // patch, rw // patch]]
    n_image = int((inputs["input_ids"] == cfg.image_token_id).sum())
    assert n_image == (rh // patch // merge) * (rw // patch // merge) > 0
    assert inputs["pixel_values"].shape[0] == (rh // patch) * (rw // patch)


def test_moe_router_logits_and_deepstack(loaded):
    model, processor = loaded["qwen3_vl_moe"]
    text = model.config.text_config
    inputs = _chat_inputs(processor)
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
    tokens = inputs["input_ids"].numel()
    assert len(out.router_logits) == text.num_hidden_layers
    assert all(r.shape == (tokens, text.num_experts) for r in out.router_logits)
    assert len(model.model.visual.deepstack_merger_list) == len(model.config.vision_config.deepstack_visual_indexes)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_bytes_other_seed_other_weights(built, family, tmp_path):
    again = build_tiny_model(family, tmp_path / "again", seed=0)
    other = build_tiny_model(family, tmp_path / "other", seed=1)
    base = built[family]
    for name in ("model.safetensors", "config.json", "tokenizer.json", "processor_config.json"):
        assert _sha256(again / name) == _sha256(base / name), name
    assert _sha256(other / "model.safetensors") != _sha256(base / "model.safetensors")
    assert (other / "config.json").read_bytes() == (base / "config.json").read_bytes()


def test_building_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("qwen2_5_vl", tmp_path, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_bad_family_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model family 'llama'.*qwen2_5_vl"):
        build_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown model family"):
        model_class("qwen2_vl")
    assert not any(tmp_path.iterdir())


def test_unknown_or_inconsistent_overrides_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown override 'hiden_size'"):
        build_tiny_model("qwen2_5_vl", tmp_path, hiden_size=64)
    with pytest.raises(ValueError, match="unknown override vision_config.'dept'"):
        build_tiny_model("qwen3_vl_moe", tmp_path, vision_config={"dept": 3})
    with pytest.raises(ValueError, match="unknown override 'num_experts'"):  # a dense family
        build_tiny_model("qwen2_5_vl", tmp_path, num_experts=4)
    with pytest.raises(ValueError, match="mrope_section"):
        build_tiny_model("qwen2_5_vl", tmp_path, mrope_section=[4, 4, 4])
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        build_tiny_model("qwen3_vl_moe", tmp_path, vision_config={"deepstack_visual_indexes": [0, 2]})
    with pytest.raises(ValueError, match="out_hidden_size"):
        build_tiny_model("qwen2_5_vl", tmp_path, vision_config={"out_hidden_size": 96})
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model("qwen2_5_vl", tmp_path, vocab_size=512)
    with pytest.raises(ValueError, match="image_token_id.*fixed by the built-in tokenizer"):
        build_tiny_model("qwen2_5_vl", tmp_path, image_token_id=5)
    with pytest.raises(ValueError, match="eos_token_id.*fixed"):
        build_tiny_model("qwen3_vl_moe", tmp_path, text_config={"eos_token_id": 5})
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model("qwen2_5_vl", tmp_path, seed="0")
    assert not any(tmp_path.iterdir())


def test_overrides_reach_the_config_and_derived_values_follow(tmp_path):
    spec = sm.resolve_config("qwen2_5_vl", hidden_size=64)  # head_dim 16
    assert spec["text"]["mrope_section"] == [2, 3, 3]
    assert spec["vision"]["out_hidden_size"] == 64
    spec = sm.resolve_config("qwen3_vl_moe", head_dim=64)
    assert spec["text"]["mrope_section"] == [12, 10, 10]  # Qwen3-VL's 24:20:20

    path = build_tiny_model(
        "qwen3_vl_moe",
        tmp_path,
        seed=3,
        num_experts=8,
        num_hidden_layers=2,
        vision_config={"depth": 3, "deepstack_visual_indexes": [1, 2]},
        dtype="bfloat16",
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["num_local_experts"] == 8
    assert cfg["text_config"]["num_hidden_layers"] == 2
    assert cfg["vision_config"]["depth"] == 3
    assert cfg["vision_config"]["deepstack_visual_indexes"] == [1, 2]
    model = model_class("qwen3_vl_moe").from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert model.model.language_model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8


def test_tokenizer_fixed_ids_and_round_trip():
    tok = sm.build_tokenizer()
    assert len(tok) == sm.TOKENIZER_SIZE == 1038
    assert [tok.convert_tokens_to_ids(t) for t in sm.SPECIAL_TOKENS] == list(range(1024, 1038))
    assert sm.SPECIAL_TOKEN_IDS["<|image_pad|>"] == 1036
    text = "<|im_start|>user\nClick the Save button at (640, 360) — café 日本<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert ids.count(1036) == 1 and max(ids) < sm.TOKENIZER_SIZE
    # The byte-level BPE learned real merges: common words are single tokens.
    assert len(tok(" the")["input_ids"]) == 1
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True).startswith("user\nClick")


def test_cli_builds_and_describes(tmp_path, capsys):
    from samcache.random_checkpoints.__main__ import main

    assert main(["qwen3_vl_moe", str(tmp_path / "m"), "--seed", "2", "--set", "num_experts=6"]) == 0
    out = capsys.readouterr().out
    assert "built Qwen3VLMoeForConditionalGeneration" in out and '"num_experts": 6' in out
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert main(["qwen2_5_vl", str(tmp_path / "x"), "--set", "bogus=1"]) == 2
    assert "unknown override 'bogus'" in capsys.readouterr().err


def test_build_preset_builds_the_tiny_sizes_and_refuses_unknown_presets(tmp_path):
    from samcache.random_checkpoints import build_preset, describe

    path = build_preset("qwen2_5_vl", "tiny", tmp_path / "t", dtype="bfloat16")  # tiny stays float32
    assert describe(path)["params"] == describe(build_tiny_model("qwen2_5_vl", tmp_path / "u"))["params"]
    assert '"float32"' in (path / "config.json").read_text()
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_preset("qwen2_5_vl", "huge", tmp_path / "h")
