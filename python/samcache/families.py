"""The model families samcache runs: one registry, used by the runner, the processor loader and
the tiny-model builders.

The runner's layer loop is the same for every family; a ``Family`` records the few places where
the architectures differ: the transformers classes, the M-RoPE layout (which the RoPE
re-rotation must match), QK-norm in attention and DeepStack visual features added to early
layers (MoE MLPs need no entry: the runner sees them per layer).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from samcache.errors import UnsupportedModel


@dataclass(frozen=True)
class Family:
    name: str  # short name, e.g. "qwen2_5_vl"
    architecture: str  # transformers model class (config.json "architectures")
    processor_class: str  # transformers processor class (processor_config.json)
    rope_style: str  # samcache.ops.rope style of the text model's M-RoPE
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    deepstack: bool  # vision features added to the first text layers' hidden states (Qwen3-VL)
    vision_attr: str = "visual"  # the vision tower's attribute of model.model ("vision_tower": InternVL)
    # How images reach the language model: "qwen" (a patch grid per image, grid_thw) or "tiles"
    # (InternVL: the image cut into tiles plus a thumbnail, a fixed token count per tile).
    vision_input: str = "qwen"

    @property
    def mrope(self) -> bool:
        """Positions are (t, h, w) triples (M-RoPE); otherwise plain 1-D RoPE on row 0."""
        from samcache.ops.rope import MROPE_STYLES

        return self.rope_style in MROPE_STYLES

    def model_class(self):
        """The transformers class holding this family's weights."""
        import transformers

        return getattr(transformers, self.architecture)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "mrope",
               qk_norm=False, deepstack=False),
        Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor", "mrope_interleaved",
               qk_norm=True, deepstack=True),
        # InternVL3.5 with a Qwen3-MoE language model (the MoE checkpoints, e.g. InternVL3.5-30B-A3B).
        Family("internvl", "InternVLForConditionalGeneration", "InternVLProcessor", "neox",
               qk_norm=True, deepstack=False, vision_attr="vision_tower", vision_input="tiles"),
    )
}


def get_family(name: str) -> Family:
    """The family called ``name`` (e.g. "qwen2_5_vl")."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def detect_family(model_path: str | pathlib.Path) -> Family:
    """The family of the checkpoint directory ``model_path`` (from its config.json)."""
    path = pathlib.Path(model_path)
    config = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(
            f"model_path {str(path)!r} is not a directory; samcache loads local Hugging Face checkpoint "
            "directories (build a tiny one with `python -m samcache.random_checkpoints qwen2_5_vl DIR`)"
        )
    if not config.is_file():
        raise UnsupportedModel(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModel(f"{config} is not valid JSON: {e}") from None
    for family in FAMILIES.values():
        if family.architecture in architectures:
            if family.name == "internvl":
                text = (json.loads(config.read_text(encoding="utf-8")).get("text_config") or {}).get("model_type")
                if text != "qwen3_moe":
                    raise UnsupportedModel(
                        f"{path} is an InternVL checkpoint with a {text or 'unknown'} language model; samcache's "
                        "engine runs InternVL3.5 with a Qwen3-MoE language model (the *-A3B checkpoints)")
            return family
    raise UnsupportedModel(
        f"{path} holds architecture {architectures or '(none)'}; samcache's engine runs "
        f"{', '.join(sorted(f.architecture for f in FAMILIES.values()))}"
    )


__all__ = ["FAMILIES", "Family", "detect_family", "get_family"]
