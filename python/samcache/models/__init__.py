"""Tiny random-weight checkpoints of real Qwen-VL architectures, built offline.

``build_tiny_model("qwen2_5_vl" | "qwen3_vl_moe", out_dir, seed=0, **overrides)`` writes config,
safetensors weights, tokenizer and processor into ``out_dir``; the directory then loads with
``AutoProcessor.from_pretrained`` and the model class's ``from_pretrained`` with no hub access.
Sizes, defaults and overrides: :mod:`samcache.models.build`; the tokenizer:
:mod:`samcache.models.tokenizer`. CLI: ``python -m samcache.models qwen2_5_vl /tmp/tiny``.

Needs the optional dependencies ``transformers``, ``tokenizers`` and ``safetensors``
(``pip install samcache[models]``); they are imported only when a model is built.
"""

from samcache.models.build import DEFAULTS, FAMILIES, build_tiny_model, describe, load_processor, resolve_config
from samcache.models.tokenizer import SPECIAL_TOKEN_IDS, SPECIAL_TOKENS, TOKENIZER_SIZE, build_tokenizer

MODEL_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


def model_class(family: str):
    """The transformers model class of ``family`` (e.g. for ``from_pretrained``)."""
    if family not in MODEL_CLASSES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    import transformers

    return getattr(transformers, MODEL_CLASSES[family])


__all__ = [
    "DEFAULTS",
    "FAMILIES",
    "MODEL_CLASSES",
    "SPECIAL_TOKENS",
    "SPECIAL_TOKEN_IDS",
    "TOKENIZER_SIZE",
    "build_tiny_model",
    "build_tokenizer",
    "describe",
    "load_processor",
    "model_class",
    "resolve_config",
]
