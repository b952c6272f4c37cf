"""Model families the engine runs, and what differs between them.

The runner's layer loop is the same for every family; a ``Family`` records the few places where
the architectures differ: the transformers class, the M-RoPE layout (which the RoPE re-rotation
must match), QK-norm in attention, and DeepStack visual features added to early layers.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from samcache.errors import UnsupportedModel


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str  # transformers class that holds the weights
    rope_style: str  # samcache.ops.rope style of the text model's M-RoPE
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    deepstack: bool  # vision features added to the first text layers' hidden states (Qwen3-VL)


FAMILIES: dict[str, Family] = {
    "Qwen2_5_VLForConditionalGeneration": Family(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "mrope", qk_norm=False, deepstack=False
    ),
    "Qwen3VLMoeForConditionalGeneration": Family(
        "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "mrope_interleaved", qk_norm=True, deepstack=True
    ),
}


def detect_family(model_path: str | pathlib.Path) -> Family:
    """The family of the checkpoint directory ``model_path`` (from its config.json)."""
    path = pathlib.Path(model_path)
    config = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(
            f"model_path {str(path)!r} is not a directory; samcache loads local Hugging Face checkpoint "
            "directories (build a tiny one with `python -m samcache.models qwen2_5_vl DIR`)"
        )
    if not config.is_file():
        raise UnsupportedModel(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModel(f"{config} is not valid JSON: {e}") from None
    for arch in architectures:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise UnsupportedModel(
        f"{path} holds architecture {architectures or '(none)'}; samcache's engine runs "
        f"{', '.join(sorted(FAMILIES))}"
    )


__all__ = ["FAMILIES", "Family", "detect_family"]
