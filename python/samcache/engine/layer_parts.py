"""What the model runner takes from a Hugging Face decoder: projections fused into one weight,
which RMS norms samcache's kernel computes, and which position row drives each RoPE frequency."""

from __future__ import annotations

from collections.abc import Sequence

import torch


# Hugging Face RMS norms that compute exactly samcache's ``rms_norm`` (weight * x / rms, no offset).
_PLAIN_RMS_NORMS = {"Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm",
                    "Qwen3VLMoeTextRMSNorm", "LlamaRMSNorm"}


def frequency_axes(style: str, mrope_section: Sequence[int], half: int) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) drives each of the ``half`` rotary frequencies:
    Qwen2.5-VL's sections (t, then h, then w), Qwen3-VL's interleaving (h at 1, 4, 7... below
    3 s_h, w at 2, 5, 8... below 3 s_w), row 0 for 1-D RoPE."""
    from samcache.ops.rope import MROPE_STYLES, STYLES

    if style not in STYLES:
        raise ValueError(f"unknown RoPE style {style!r}; one of {', '.join(STYLES)}")
    if isinstance(half, bool) or not isinstance(half, int) or half < 1:
        raise ValueError(f"half (rotary frequencies) must be an int >= 1, got {half!r}")
    section = [int(x) for x in mrope_section]
    if style in MROPE_STYLES and (len(section) != 3 or min(section) < 0 or sum(section) != half):
        raise ValueError(f"RoPE style {style!r} needs mrope_section of 3 counts >= 0 summing to {half} "
                         f"(the rotary frequencies), got {section}")
    axes = torch.zeros(half, dtype=torch.int64)
    if style == "mrope":
        s_t, s_h, _ = section
        axes[s_t: s_t + s_h] = 1
        axes[s_t + s_h:] = 2
    elif style == "mrope_interleaved":
        j = torch.arange(half)
        axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


def plain_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an RMS norm samcache's ``rms_norm`` kernel computes exactly."""
    return (type(module).__name__ in _PLAIN_RMS_NORMS and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def fuse_linear(modules: list[torch.nn.Linear], name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear layers over the same input, the layers' own
    parameters becoming views of it (done once per model; later calls find the views)."""
    fused = getattr(modules[0], f"_samcache_{name}", None)
    if fused is not None:
        return fused
    w = torch.cat([m.weight.data for m in modules])
    biases = [m.bias for m in modules]
    b = torch.cat([x.data for x in biases]) if all(x is not None for x in biases) else None
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = w[row: row + n]
        if b is not None:
            m.bias.data = b[row: row + n]
        row += n
    modules[0].__dict__[f"_samcache_{name}"] = (w, b)
    return w, b


__all__ = ["frequency_axes", "fuse_linear", "plain_rms_norm"]
