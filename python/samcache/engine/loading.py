"""Loading a checkpoint: the device and dtype to run it in, its processor, its identity.

Runtime code: the engine, the benchmark and the integrations use these; the tiny-model builders
(``samcache.random_checkpoints``, test fixtures) are never imported from here.
"""

from __future__ import annotations

import json
import pathlib

import torch

from samcache.families import FAMILIES
from samcache.model_identity import model_fingerprint  # re-exported: samcache.engine.model_fingerprint

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device ('cpu', 'cuda', 'cuda:N'); None picks CUDA when there is a GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype (names and aliases accepted); None: bfloat16 on CUDA, float32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


_NO_VIDEO_CLASSES: dict[str, type] = {}


def _no_video_processor_class(processor_class: str) -> type:
    """``processor_class`` accepting ``video_processor=None`` (images and text only)."""
    if processor_class not in _NO_VIDEO_CLASSES:
        import transformers

        base = getattr(transformers, processor_class)

        class NoVideo(base):
            def check_argument_for_proper_class(self, argument_name, argument):
                if argument_name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(argument_name, argument)

            def __call__(self, images=None, text=None, videos=None, **kwargs):
                if videos is not None and self.video_processor is None:
                    raise ValueError("this processor was loaded without torchvision and cannot process videos")
                return super().__call__(images=images, text=text, **kwargs)

        # Keeps processor_class (to_dict) and messages identical to the real class.
        NoVideo.__name__ = NoVideo.__qualname__ = base.__name__
        _NO_VIDEO_CLASSES[processor_class] = NoVideo
    return _NO_VIDEO_CLASSES[processor_class]


def load_processor(path: str | pathlib.Path):
    """Load the processor of a checkpoint directory offline.

    ``transformers.AutoProcessor.from_pretrained(path)`` where torchvision is usable (it needs it
    for the Qwen video processor); otherwise the same processor class, built from the same files
    (tokenizer, ``Qwen2VLImageProcessorPil``, chat template) without a video processor: images and
    text work as with AutoProcessor, video inputs raise ``ValueError``.
    """
    from transformers.utils import is_torchvision_available

    path = pathlib.Path(path)
    if is_torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)
    from transformers import AutoTokenizer, GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil

    config = json.loads((path / "processor_config.json").read_text())
    processor_class = config["processor_class"]
    if processor_class not in {f.processor_class for f in FAMILIES.values()}:
        raise ValueError(f"{path} holds a {processor_class}, not the processor of a family samcache runs "
                         f"({', '.join(sorted(f.processor_class for f in FAMILIES.values()))})")
    cfg = {k: v for k, v in config["image_processor"].items() if k not in ("image_processor_type", "processor_class")}
    extra = {}
    if processor_class == "InternVLProcessor":  # tiles (GOT-OCR2's cropping) and tokens per tile
        image_processor = GotOcr2ImageProcessorPil(**cfg)
        extra["image_seq_length"] = int(config["image_seq_length"])
    else:
        image_processor = Qwen2VLImageProcessorPil(**cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return _no_video_processor_class(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template,
        **extra)


__all__ = ["load_processor", "model_fingerprint", "resolve_device", "resolve_dtype"]
