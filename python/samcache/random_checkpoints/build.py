"""Build tiny random-weight checkpoints of real Qwen-VL architectures, offline.

``build_tiny_model(family, out_dir, seed=0, **overrides)`` writes a directory laid out like a
real checkpoint saved by transformers 5::

    config.json  generation_config.json  model.safetensors        the model
    tokenizer.json  tokenizer_config.json                         the tokenizer (Qwen2Tokenizer)
    processor_config.json  chat_template.jinja                    image + video processor, template

``Qwen2_5_VLForConditionalGeneration.from_pretrained(dir)`` /
``Qwen3VLMoeForConditionalGeneration.from_pretrained(dir)``, ``AutoConfig``, ``AutoTokenizer`` and
``AutoImageProcessor`` load it offline (``HF_HUB_OFFLINE=1``). ``AutoProcessor.from_pretrained``
loads it wherever torchvision works: transformers 5 will not build a Qwen-VL processor without its
(torchvision-only) video processor. With a CPU torch, PyPI's torchvision does not load, so
:func:`load_processor` builds the same processor class from the same files with the pure-PIL
``Qwen2VLImageProcessorPil`` and no video processor (images and text behave exactly as with
AutoProcessor; it uses AutoProcessor itself when torchvision is importable).

Families and their defaults (see :data:`DEFAULTS`; every size is a real config field):

``qwen2_5_vl`` -- ``Qwen2_5_VLForConditionalGeneration``: dense text model, sectioned M-RoPE.
    text: hidden 128, 2 layers, 4 heads / 2 KV heads (head_dim 32), MLP 256, mrope_section
    [4, 6, 6] (sums to head_dim/2; Qwen2.5-VL's 16:24:24 proportions), rope_theta 1e6.
    vision: depth 2, hidden 64, 4 heads, MLP 128, patch 14, spatial merge 2, temporal patch 2,
    window 112 px with block 1 full attention (block 0 windowed), out_hidden_size = text hidden.
    processor: CLIP mean/std, min_pixels 56*56, max_pixels 28*28*1280 (Qwen2.5-VL's); one image
    token per 28x28 pixels (a 112x84 image: grid (1, 6, 8), 12 tokens).
    832 k parameters, 3.4 MB on disk.

``qwen3_vl_moe`` -- ``Qwen3VLMoeForConditionalGeneration``: MoE text model (router logits),
    interleaved M-RoPE, deepstack visual features.
    text: hidden 128, 3 layers, every one MoE: 4 experts, top-2, expert MLP 32; 4 heads / 2 KV
    heads, head_dim 32, mrope_section [6, 5, 5] (Qwen3-VL's 24:20:20), interleaved, rope_theta 5e6.
    vision: depth 2, hidden 64, 4 heads, MLP 128, gelu_pytorch_tanh, patch 16 (Qwen3-VL's real
    patch size; ``vision_config={"patch_size": 14}`` for Qwen2-style grids), spatial merge 2,
    576 learned position embeddings (24x24, interpolated), deepstack_visual_indexes [0, 1]
    (their features are added to text layers 0 and 1).
    processor: mean/std 0.5, min_pixels 65536, max_pixels 16777216 (Qwen3-VL's); one image token
    per 32x32 pixels (a 112x84 image is scaled up to 320x224: grid (1, 14, 20), 70 tokens).
    1.08 M parameters, 4.4 MB on disk.

Both share one tokenizer (:mod:`samcache.random_checkpoints.tokenizer`): 1,024 byte-level BPE tokens, then
Qwen's 14 special tokens at ids 1024..1037 (``<|image_pad|>`` = 1036); the embedding table has
``vocab_size`` 1088 rows (padded to a multiple of 64, as Qwen pads its 151,665 ids to 151,936).
Weights are float32 (``dtype="bfloat16"`` to change), initialised by the model's own
``_init_weights`` under ``torch.manual_seed(seed)``: the same seed gives byte-identical
safetensors.

Overrides (keyword arguments) name real config fields:

* a field of the family's text config goes there (``hidden_size=64``, ``num_experts=8``), also
  ``rope_theta`` and ``mrope_section``;
* ``vision_config={...}`` / ``text_config={...}`` update those sub-configs field by field;
* top-level fields (``tie_word_embeddings``, ...), ``dtype``, and the processor's ``min_pixels`` /
  ``max_pixels``.

Anything else raises ``ValueError`` naming the key. Derived values follow the overrides unless
given: ``mrope_section`` from ``head_dim``, vision ``out_hidden_size`` = text ``hidden_size``.
Inconsistent values (sections not summing to head_dim/2, deepstack or full-attention indexes
outside the vision depth, a vocabulary smaller than the tokenizer) raise ``ValueError``.

Why this module is long: each family's defaults are real config fields, listed here beside the one
writer of the checkpoint directory, so that a size and the file that carries it are read together.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
from typing import Any

from samcache.families import FAMILIES as _REGISTRY
from samcache.families import get_family
from samcache.engine.loading import load_processor  # noqa: F401  (re-exported: builders load what they wrote)
from samcache.random_checkpoints.tokenizer import INTERNVL_TOKENS, SPECIAL_TOKEN_IDS, TOKENIZER_SIZE, build_tokenizer

FAMILIES = tuple(_REGISTRY)  # the family names of samcache.families

_VOCAB_SIZE = 1088  # TOKENIZER_SIZE (1038) rounded up to a multiple of 64

_TOKEN_IDS = {
    "image_token_id": SPECIAL_TOKEN_IDS["<|image_pad|>"],
    "video_token_id": SPECIAL_TOKEN_IDS["<|video_pad|>"],
    "vision_start_token_id": SPECIAL_TOKEN_IDS["<|vision_start|>"],
    "vision_end_token_id": SPECIAL_TOKEN_IDS["<|vision_end|>"],
}
#: InternVL's image-context token: the third of its markup tokens after Qwen's (1040).
_INTERNVL_IMAGE_ID = TOKENIZER_SIZE + list(INTERNVL_TOKENS).index("context_image_token")
_BOS = SPECIAL_TOKEN_IDS["<|endoftext|>"]
_EOS = SPECIAL_TOKEN_IDS["<|im_end|>"]
_PAD = SPECIAL_TOKEN_IDS["<|endoftext|>"]

#: Per family: "text" and "vision" sub-config fields, "top" fields, "processor" settings.
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen2_5_vl": {
        "text": {
            "vocab_size": _VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "mrope_section": None,  # derived: [4, 6, 6] for head_dim 32
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 2,
            "bos_token_id": _BOS,
            "eos_token_id": _EOS,
            "pad_token_id": _PAD,
        },
        "vision": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "hidden_act": "silu",
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "out_hidden_size": None,  # derived: text hidden_size
        },
        "top": {"tie_word_embeddings": False, **_TOKEN_IDS},
        "processor": {
            "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 1280,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    },
    "qwen3_vl_moe": {
        "text": {
            "vocab_size": _VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 5000000.0,
            "mrope_section": None,  # derived: [6, 5, 5] for head_dim 32
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "bos_token_id": _BOS,
            "eos_token_id": _EOS,
            "pad_token_id": _PAD,
        },
        "vision": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "hidden_act": "gelu_pytorch_tanh",
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 576,
            "deepstack_visual_indexes": [0, 1],
            "out_hidden_size": None,  # derived: text hidden_size
        },
        "top": {"tie_word_embeddings": False, **_TOKEN_IDS},
        "processor": {
            "min_pixels": 65536,
            "max_pixels": 16777216,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    },
    "internvl": {
        "text": {  # Qwen3-MoE, as InternVL3.5's MoE models (1-D RoPE, QK-norm, every layer MoE)
            "vocab_size": _VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "bos_token_id": _BOS,
            "eos_token_id": _EOS,
            "pad_token_id": _PAD,
        },
        "vision": {  # InternViT: 64 px tiles of 8 px patches, pixel-shuffled to 16 tokens a tile
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "image_size": 64,
            "patch_size": 8,
        },
        "top": {"tie_word_embeddings": False, "image_token_id": _INTERNVL_IMAGE_ID, "downsample_ratio": 0.5,
                "image_seq_length": None},  # derived: (image_size / patch_size)^2 * downsample_ratio^2
        "processor": {
            "min_patches": 1,
            "max_patches": 4,  # InternVL3.5's is 12; 4 keeps a test screenshot at 5 tiles (80 tokens)
            "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225],
        },
    },
}

# Qwen chat markup shared by both templates: turns and vision placeholders (the engine looks
# for the literal <|vision_start|><|image_pad|><|vision_end|>).
_CHAT_TURNS = (
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CHAT_COUNTERS = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"

# Qwen2.5-VL's chat template (adds the default system prompt).
_QWEN2_5_VL_CHAT_TEMPLATE = (
    _CHAT_COUNTERS
    + "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + _CHAT_TURNS
)

# A reduced Qwen3-VL template: same turn and vision markup, no default system prompt (as the
# Instruct models); tool calls and thinking blocks of the real template are left out.
_QWEN3_VL_CHAT_TEMPLATE = _CHAT_COUNTERS + "{% for message in messages %}" + _CHAT_TURNS

# InternVL3.5's markup: Qwen's turns, one <IMG_CONTEXT> line per image (the processor expands it
# to <img> + <IMG_CONTEXT> x tokens + </img>); no default system prompt.
_INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'video' or 'video' in content %}<video>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _classes(family: str):
    """(top config, text config, vision config, model, processor class, chat template); the model
    and processor classes are the registry's."""
    import transformers

    registered = get_family(family)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLTextConfig,
            Qwen2_5_VLVisionConfig,
        )

        configs, template = (Qwen2_5_VLConfig, Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig), _QWEN2_5_VL_CHAT_TEMPLATE
    elif family == "internvl":
        from transformers import InternVLConfig, InternVLVisionConfig, Qwen3MoeConfig

        configs, template = (InternVLConfig, Qwen3MoeConfig, InternVLVisionConfig), _INTERNVL_CHAT_TEMPLATE
    else:
        from transformers import Qwen3VLMoeConfig
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
            Qwen3VLMoeTextConfig,
            Qwen3VLMoeVisionConfig,
        )

        configs, template = (Qwen3VLMoeConfig, Qwen3VLMoeTextConfig, Qwen3VLMoeVisionConfig), _QWEN3_VL_CHAT_TEMPLATE
    return (*configs, registered.model_class(), getattr(transformers, registered.processor_class), template)


def _own_fields(cls) -> set[str]:
    """The config fields a class adds to ``PreTrainedConfig`` (the ones worth overriding)."""
    from transformers import PreTrainedConfig

    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    return {f.name for f in dataclasses.fields(cls)} - base


def _fixed_ids(family: str) -> dict[str, int]:
    """The config's token ids the built-in tokenizer decides."""
    ids = {"image_token_id": _INTERNVL_IMAGE_ID} if family == "internvl" else dict(_TOKEN_IDS)
    return {**ids, "bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _PAD}


def resolve_config(family: str, **overrides) -> dict[str, dict[str, Any]]:
    """The settings ``build_tiny_model(family, ..., **overrides)`` would use, checked.

    Returns ``{"text": ..., "vision": ..., "top": ..., "processor": ...}`` with derived values
    filled in. Raises ``ValueError`` for an unknown family, an unknown key or inconsistent values.
    """
    get_family(family)  # a clear error for an unknown family
    top_cls, text_cls, vision_cls, *_ = _classes(family)
    spec = copy.deepcopy(DEFAULTS[family])
    tiles = family == "internvl"
    text_keys = _own_fields(text_cls) | ({"rope_theta", "head_dim"} if tiles else {"rope_theta", "mrope_section"})
    vision_keys = _own_fields(vision_cls)
    top_keys = _own_fields(top_cls) - {"text_config", "vision_config"}
    proc_keys = ({"min_patches", "max_patches", "image_mean", "image_std"} if tiles
                 else {"min_pixels", "max_pixels", "image_mean", "image_std"})
    fixed_ids = _fixed_ids(family)
    fixed = set(fixed_ids)  # set by the tokenizer

    def update(section: str, allowed: set[str], items: dict[str, Any], where: str) -> None:
        for key, value in items.items():
            if key in fixed:
                raise ValueError(f"override {where}{key!r} is fixed by the built-in tokenizer ({key} = {fixed_ids[key]})")
            if key not in allowed:
                raise ValueError(
                    f"unknown override {where}{key!r} for {family}; allowed: {', '.join(sorted(allowed))}"
                )
            spec[section][key] = copy.deepcopy(value)

    for key, value in overrides.items():
        if key in fixed:
            raise ValueError(f"override {key!r} is fixed by the built-in tokenizer ({key} = {fixed_ids[key]})")
        if key in ("text_config", "vision_config"):
            if not isinstance(value, dict):
                raise ValueError(f"override {key} must be a dict of fields, got {type(value).__name__}")
            section = "text" if key == "text_config" else "vision"
            update(section, text_keys if section == "text" else vision_keys, value, f"{key}.")
        elif key == "dtype":
            if value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {value!r}")
            spec["top"]["dtype"] = value
        elif key in text_keys:
            spec["text"][key] = copy.deepcopy(value)
        elif key in top_keys:
            spec["top"][key] = copy.deepcopy(value)
        elif key in proc_keys:
            spec["processor"][key] = copy.deepcopy(value)
        else:
            allowed = sorted(text_keys | top_keys | proc_keys | {"dtype", "text_config", "vision_config"})
            raise ValueError(f"unknown override {key!r} for {family}; allowed: {', '.join(allowed)}")
    spec["top"].setdefault("dtype", "float32")

    text, vision = spec["text"], spec["vision"]
    heads = text["num_attention_heads"]
    if text["hidden_size"] % heads and "head_dim" not in text:
        raise ValueError(f"hidden_size {text['hidden_size']} is not a multiple of num_attention_heads {heads}")
    if heads % text["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {text['num_key_value_heads']}"
        )
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    if tiles:
        return _check_internvl(spec)
    half = head_dim // 2
    if text["mrope_section"] is None:
        if family == "qwen2_5_vl":  # Qwen2.5-VL: [16, 24, 24] of 64
            hw = 3 * half // 8
        else:  # Qwen3-VL: [24, 20, 20] of 64
            hw = 5 * half // 16
        text["mrope_section"] = [half - 2 * hw, hw, hw]
    section = list(text["mrope_section"])
    if len(section) != 3 or sum(section) != half or min(section) < 0:
        raise ValueError(f"mrope_section {section} must be 3 sizes summing to head_dim/2 = {half}")
    if vision["out_hidden_size"] is None:
        vision["out_hidden_size"] = text["hidden_size"]
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError(
            f"vision out_hidden_size {vision['out_hidden_size']} must equal text hidden_size {text['hidden_size']}"
        )
    depth = vision["depth"]
    if vision["hidden_size"] % vision["num_heads"]:
        raise ValueError(f"vision hidden_size {vision['hidden_size']} not a multiple of num_heads {vision['num_heads']}")
    for key in ("deepstack_visual_indexes", "fullatt_block_indexes"):
        bad = [i for i in vision.get(key, ()) if not 0 <= i < depth]
        if bad:
            raise ValueError(f"vision {key} {list(vision[key])} must lie in [0, depth={depth})")
    if family == "qwen3_vl_moe":
        if len(vision["deepstack_visual_indexes"]) > text["num_hidden_layers"]:
            raise ValueError("more deepstack_visual_indexes than text layers to inject them into")
        if not 1 <= text["num_experts_per_tok"] <= text["num_experts"]:
            raise ValueError(f"num_experts_per_tok must lie in [1, num_experts={text['num_experts']}]")
        n = vision["num_position_embeddings"]
        if int(n**0.5) ** 2 != n:
            raise ValueError(f"vision num_position_embeddings {n} must be a perfect square")
    if text["vocab_size"] < TOKENIZER_SIZE:
        raise ValueError(f"vocab_size {text['vocab_size']} is smaller than the tokenizer ({TOKENIZER_SIZE} ids)")
    return spec


def _check_internvl(spec: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """InternVL's own checks; derives ``image_seq_length`` (tokens a tile becomes)."""
    text, vision, top = spec["text"], spec["vision"], spec["top"]
    size, patch = vision["image_size"], vision["patch_size"]
    if not (isinstance(size, int) and isinstance(patch, int)) or size % patch:
        raise ValueError(f"vision image_size {size} must be a multiple of patch_size {patch} (square tiles)")
    side = size // patch * top["downsample_ratio"]
    if side != int(side) or side < 1:
        raise ValueError(f"{size // patch} patches a side cannot be pixel-shuffled by {top['downsample_ratio']}")
    if top["image_seq_length"] is None:
        top["image_seq_length"] = int(side) ** 2
    if top["image_seq_length"] != int(side) ** 2:
        raise ValueError(f"image_seq_length {top['image_seq_length']} must be {int(side) ** 2} for these tiles")
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise ValueError(f"vision hidden_size {vision['hidden_size']} not a multiple of "
                         f"num_attention_heads {vision['num_attention_heads']}")
    if not 1 <= text["num_experts_per_tok"] <= text["num_experts"]:
        raise ValueError(f"num_experts_per_tok must lie in [1, num_experts={text['num_experts']}]")
    if not 1 <= spec["processor"]["min_patches"] <= spec["processor"]["max_patches"]:
        raise ValueError("the processor needs 1 <= min_patches <= max_patches")
    if text["vocab_size"] < TOKENIZER_SIZE + len(INTERNVL_TOKENS):
        raise ValueError(f"vocab_size {text['vocab_size']} is smaller than the tokenizer")
    return spec


def _make_config(family: str, spec: dict[str, dict[str, Any]]):
    top_cls, text_cls, vision_cls, *_ = _classes(family)
    text = dict(spec["text"])
    if family == "internvl":  # 1-D RoPE
        dtype = spec["top"]["dtype"]
        text_config = text_cls(**{k: v for k, v in text.items() if k != "rope_theta"}, dtype=dtype,
                               tie_word_embeddings=spec["top"]["tie_word_embeddings"],
                               rope_parameters={"rope_type": "default", "rope_theta": text["rope_theta"]})
        vision_config = vision_cls(**spec["vision"])
        top = {k: v for k, v in spec["top"].items() if k != "dtype"}
        return top_cls(text_config=text_config.to_dict(), vision_config=vision_config.to_dict(), dtype=dtype, **top)
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "mrope_section": text.pop("mrope_section")}
    if family == "qwen3_vl_moe":
        rope["mrope_interleaved"] = True
    dtype = spec["top"]["dtype"]
    if "tie_word_embeddings" in _own_fields(text_cls):  # keep the text config's copy consistent
        text["tie_word_embeddings"] = spec["top"]["tie_word_embeddings"]
    text_config = text_cls(**text, rope_parameters=rope, dtype=dtype)
    vision_config = vision_cls(**spec["vision"], initializer_range=0.02)
    top = {k: v for k, v in spec["top"].items() if k != "dtype"}
    return top_cls(text_config=text_config.to_dict(), vision_config=vision_config.to_dict(), dtype=dtype, **top)


def _image_processor(spec: dict[str, dict[str, Any]]):
    from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil

    vision, proc = spec["vision"], spec["processor"]
    if "min_patches" in proc:  # InternVL: square tiles of the vision tower's size, plus a thumbnail
        side = vision["image_size"]
        return GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True,
                                        min_patches=proc["min_patches"], max_patches=proc["max_patches"],
                                        image_mean=list(proc["image_mean"]), image_std=list(proc["image_std"]))
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": proc["min_pixels"], "longest_edge": proc["max_pixels"]},
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        image_mean=list(proc["image_mean"]),
        image_std=list(proc["image_std"]),
    )


def _video_processor_dict(family: str, spec: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The video processor's section of processor_config.json, written as data.

    transformers' Qwen video processors need torchvision (unusable here with a CPU torch), so it
    is never instantiated while building; an environment with torchvision loads it from this.
    """
    vision, proc = spec["vision"], spec["processor"]
    px = vision["patch_size"] * vision["spatial_merge_size"]
    d = {
        "video_processor_type": "Qwen2VLVideoProcessor" if family == "qwen2_5_vl" else "Qwen3VLVideoProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(proc["image_mean"]),
        "image_std": list(proc["image_std"]),
        "merge_size": vision["spatial_merge_size"],
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": 128 * px * px, "longest_edge": 768 * px * px},
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": True,  # qwen-vl-utils' per-frame pixel cap (the reference)
    }
    if family == "qwen2_5_vl":
        d["do_sample_frames"] = False
    else:
        d.update(do_sample_frames=True, fps=2)
    return d


def _write_processor(out: pathlib.Path, family: str, spec: dict[str, dict[str, Any]]) -> None:
    """tokenizer.json/tokenizer_config.json, chat_template.jinja and processor_config.json.

    Written file by file in the layout ``ProcessorMixin.save_pretrained`` produces: transformers
    cannot build a Qwen-VL processor object without torchvision (it insists on a video
    processor), but it can load one from these files where torchvision is installed.
    """
    import json

    *_, processor_cls, chat_template = _classes(family)
    tiles = family == "internvl"
    tokenizer = build_tokenizer(model_tokens=INTERNVL_TOKENS if tiles else None)
    tokenizer._set_processor_class(processor_cls.__name__)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    image = _image_processor(spec).to_dict()
    if tiles:
        image = {k: list(v) if isinstance(v, tuple) else int(v) if k == "resample" else v for k, v in image.items()}
        side = spec["vision"]["image_size"]
        video = {"video_processor_type": "InternVLVideoProcessor", "size": {"height": side, "width": side},
                 "image_mean": image["image_mean"], "image_std": image["image_std"], "do_resize": True,
                 "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
                 "rescale_factor": 1 / 255, "initial_shift": True, "do_sample_frames": False}
        config = {"image_processor": image, "image_seq_length": spec["top"]["image_seq_length"],
                  "processor_class": processor_cls.__name__, "video_processor": video}
        (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                                   encoding="utf-8")
        return
    image["image_processor_type"] = "Qwen2VLImageProcessor"
    config = {
        "image_processor": image,
        "processor_class": processor_cls.__name__,
        "video_processor": _video_processor_dict(family, spec),
    }
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_model(family: str, out_dir, *, seed: int = 0, **overrides) -> pathlib.Path:
    """Write a tiny random-weight checkpoint of ``family`` into ``out_dir`` and return its path.

    ``family`` is ``"qwen2_5_vl"`` or ``"qwen3_vl_moe"``; ``seed`` fixes the weights (same seed,
    byte-identical ``model.safetensors``); ``overrides`` change config fields (see the module
    docstring). Existing files of the same names in ``out_dir`` are replaced.
    """
    get_family(family)  # a clear error for an unknown family
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    spec = resolve_config(family, **overrides)

    import torch
    from transformers import GenerationConfig

    *_, model_cls, _, _ = _classes(family)
    config = _make_config(family, spec)
    dtype = getattr(torch, spec["top"]["dtype"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=_BOS, eos_token_id=[_EOS, _BOS], pad_token_id=_PAD, do_sample=False
    )

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _write_processor(out, family, spec)
    return out


def describe(path) -> dict[str, Any]:
    """A short summary of a built checkpoint directory (what the CLI prints)."""
    import json

    path = pathlib.Path(path)
    cfg = json.loads((path / "config.json").read_text())
    text, vision = dict(cfg["text_config"]), cfg["vision_config"]
    if "num_local_experts" in text:
        text["num_experts"] = text["num_local_experts"]
    weights = sorted(path.glob("*.safetensors"))
    from safetensors import safe_open

    params = 0
    for w in weights:
        with safe_open(w, "pt") as f:
            for k in f.keys():
                params += _prod(f.get_slice(k).get_shape())
    return {
        "path": str(path),
        "architecture": cfg["architectures"][0],
        "params": params,
        "bytes": sum(p.stat().st_size for p in path.iterdir() if p.is_file()),
        "text": {k: text.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                                          "num_experts_per_tok", "rope_parameters") if k in text},
        "vision": {k: vision.get(k) for k in ("depth", "hidden_size", "patch_size", "spatial_merge_size",
                                              "deepstack_visual_indexes", "fullatt_block_indexes") if k in vision},
        "token_ids": {k: cfg.get(k) for k in _TOKEN_IDS},
        "files": sorted(p.name for p in path.iterdir()),
    }


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


