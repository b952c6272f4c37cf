"""Tiny random-weight checkpoints of real Qwen-VL architectures, built offline.

``build_tiny_model("qwen2_5_vl" | "qwen3_vl_moe", out_dir, seed=0, **overrides)`` writes config,
safetensors weights, tokenizer and processor into ``out_dir``; the directory then loads with
``AutoProcessor.from_pretrained`` and the model class's ``from_pretrained`` with no hub access.
Sizes, defaults and overrides: :mod:`samcache.random_checkpoints.build`; the tokenizer:
:mod:`samcache.random_checkpoints.tokenizer`. CLI: ``python -m samcache.random_checkpoints qwen2_5_vl /tmp/tiny``.

Needs the optional dependencies ``transformers``, ``tokenizers`` and ``safetensors``
(``pip install samcache[models]``); they are imported only when a model is built.
"""

from samcache.random_checkpoints.build import DEFAULTS, FAMILIES, build_tiny_model, describe, load_processor, resolve_config
from samcache.random_checkpoints.tokenizer import SPECIAL_TOKEN_IDS, SPECIAL_TOKENS, TOKENIZER_SIZE, build_tokenizer

#: Size presets for build_tiny_model(family, dir, **PRESETS[name]): the real text and vision sizes
#: of public checkpoints with random weights (and the tiny tokenizer), for GPU benchmarks.
PRESETS: dict[str, dict] = {
    "tiny": {},
    # The CPU comparison against vLLM (docs/benchmark.md): 4 layers, hidden 256, 4 heads over 2 KV
    # heads of 64 dims (the layout of the measurement in the project's anchors), 4.0 M parameters.
    "small": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768),
    # Memory tiers on the CPU (bench/bench_tiers.py): a page's prefill costs far more than loading
    # its KV (8 layers of hidden 512, 2 KV heads of 64 dims: 8 KiB of float32 KV a token).
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                   intermediate_size=1536),
    # Visual-token compression on the CPU (qwen3_vl_moe): deep enough for the seed's three stages
    # (layers 0 / 1 / 3 of 12), 8 experts, top-2.
    "moe-small": dict(hidden_size=256, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
    # Qwen3-VL-30B-A3B's sizes (qwen3_vl_moe), random weights: for a GPU.
    "qwen3-vl-30b-a3b": dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        mrope_section=[24, 20, 20],
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                           deepstack_visual_indexes=[8, 16, 24]),
    ),
    "qwen2.5-vl-7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_window_layers=28, mrope_section=[16, 24, 24],
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           fullatt_block_indexes=[7, 15, 23, 31], window_size=112),
    ),
}

def build_preset(family: str, preset: str, out_dir, *, dtype: str | None = None, seed: int = 0):
    """``build_tiny_model(family, out_dir, **PRESETS[preset])``; real-size presets are written in
    ``dtype`` (e.g. "bfloat16": a float32 7B checkpoint is 33 GB), the tiny one always in float32."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    sizes = dict(PRESETS[preset])
    if preset != "tiny" and dtype is not None:
        sizes["dtype"] = dtype
    return build_tiny_model(family, out_dir, seed=seed, **sizes)


def model_class(family: str):
    """The transformers model class of ``family`` (e.g. for ``from_pretrained``)."""
    from samcache.families import get_family

    return get_family(family).model_class()


__all__ = [
    "DEFAULTS",
    "FAMILIES",
    "PRESETS",
    "SPECIAL_TOKENS",
    "SPECIAL_TOKEN_IDS",
    "TOKENIZER_SIZE",
    "build_preset",
    "build_tiny_model",
    "build_tokenizer",
    "describe",
    "load_processor",
    "model_class",
    "resolve_config",
]
