"""Image-isolated attention in a Hugging Face forward: the reference a served model must equal, and
what training and ``samcache adapt`` compute.

A served isolated image is computed alone after its segment prefix (the sink and its frame token,
:meth:`ImageAttention.segment_prefix`) at canonical positions, then re-rotated into place. One
ordinary forward of the whole prompt computes exactly that with two changes (:func:`isolate_batch`):

- before each image's frame token go *copies* of its segment prefix, at the positions the canonical
  ones take when the image moves to where it is (image start ``p``: sink copy ``p - 2``, frame copy
  ``p - 1``). RoPE depends on position differences only, so an image attending to its copies sees
  what it sees alone at positions 0, 1, 2, ...;
- an explicit 4-D mask per layer: text tokens attend causally to every token but the copies; an
  image's tokens attend to its copies and its own tokens before them (in the isolated layers), or
  like text (in the top ``context_layers``); a copy attends to its own image's copies before it.

The copies carry no labels. :func:`layer_masks` applies the per-layer masks to a model for the
duration of a forward.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator, Sequence

import torch

from samcache.profile.image_attention import ImageAttention

#: Prepended to an isolated checkpoint's chat template: "Picture k: " before each image unless the
#: caller says otherwise, so that every engine rendering the template gives the image's index in text.
VISION_IDS_DEFAULT = "{% if add_vision_id is not defined %}{% set add_vision_id = true %}{% endif %}"


def enable_vision_ids(checkpoint: str | pathlib.Path) -> None:
    """Make ``add_vision_id`` the default of a checkpoint's chat template (chat_template.jinja)."""
    path = pathlib.Path(checkpoint) / "chat_template.jinja"
    if not path.is_file():
        raise ValueError(f"{checkpoint} has no chat_template.jinja to turn vision ids on in")
    text = path.read_text()
    if "add_vision_id" not in text:
        raise ValueError(f"{path} does not render vision ids (no add_vision_id in the template)")
    if not text.startswith(VISION_IDS_DEFAULT):
        path.write_text(VISION_IDS_DEFAULT + text)


def vision_ids_enabled(checkpoint: str | pathlib.Path) -> bool:
    path = pathlib.Path(checkpoint) / "chat_template.jinja"
    return path.is_file() and path.read_text().startswith(VISION_IDS_DEFAULT)


#: What a chat template writes for an image, and the token it repeats after it as link tokens.
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
LINK_TOKEN = "<|vision_pad|>"


def enable_link_tokens(checkpoint: str | pathlib.Path, count: int) -> None:
    """Make a checkpoint's chat template write ``count`` link tokens (``<|vision_pad|>``) after
    each image: text tokens, so they attend in context (to the image and to its "Picture k: "),
    always computed, binding an isolated image to its place (KVLink's link tokens)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"link tokens must be an int >= 1, got {count!r}")
    path = pathlib.Path(checkpoint) / "chat_template.jinja"
    text = path.read_text()
    if text.count(IMAGE_MARKUP) != 1:
        raise ValueError(f"{path}: expected the image markup {IMAGE_MARKUP} once, found it {text.count(IMAGE_MARKUP)} times")
    if link_tokens(checkpoint):
        raise ValueError(f"{path} already writes link tokens after each image")
    path.write_text(text.replace(IMAGE_MARKUP, IMAGE_MARKUP + LINK_TOKEN * count))


def link_tokens(checkpoint: str | pathlib.Path) -> int:
    """How many link tokens a checkpoint's chat template writes after each image."""
    path = pathlib.Path(checkpoint) / "chat_template.jinja"
    if not path.is_file():
        return 0
    text = path.read_text()
    at = text.find(IMAGE_MARKUP)
    if at < 0:
        return 0
    rest, n = text[at + len(IMAGE_MARKUP):], 0
    while rest.startswith(LINK_TOKEN):
        rest, n = rest[len(LINK_TOKEN):], n + 1
    return n


def _image_spans(ids: Sequence[int], image_token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of ``image_token`` in ``ids``."""
    spans, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == image_token:
            j = i
            while j < n and ids[j] == image_token:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def _base(model):
    """The Hugging Face model under a peft wrapper (LoRA), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def isolate_batch(model, batch: dict, attention: ImageAttention) -> dict:
    """``batch`` (a processor's output for ``model``, right-padded, optionally with ``labels`` and
    ``loss_weights``) rewritten for ``attention``: input ids with each image's segment-prefix
    copies, ``position_ids`` [3, B, L'], and ``layer_masks`` (one additive 4-D mask [B, 1, L', L']
    per decoder layer). For causal attention only the positions are added and ``layer_masks`` is
    None (the model's own causal mask)."""
    model = _base(model)
    config = model.config
    text = getattr(config, "text_config", config)
    num_layers = text.num_hidden_layers
    attention.check_depth(num_layers)
    input_ids, mask2d = batch["input_ids"], batch["attention_mask"]
    positions, _ = model.model.get_rope_index(input_ids, batch["mm_token_type_ids"], batch.get("image_grid_thw"),
                                              attention_mask=mask2d)
    out = dict(batch)
    out.pop("attention_mask")
    if not attention.isolated:
        out["position_ids"], out["attention_mask"], out["layer_masks"] = positions, mask2d, None
        return out
    image_token, frame_token = config.image_token_id, config.vision_start_token_id
    rows = []  # per row: (ids, positions [3, n], group [n], is_copy [n], labels, weights, real length)
    for b in range(input_ids.shape[0]):
        n = int(mask2d[b].sum())
        ids = input_ids[b, :n].tolist()
        pos = positions[:, b, :n]
        spans = _image_spans(ids, image_token)
        prefix = attention.segment_prefix(ids[0], frame_token)
        new_ids, new_pos, group, copy, keep = [], [], [], [], []  # keep: index into the original row, -1 for a copy
        cursor = 0
        for m, (lo, hi) in enumerate(spans):
            if lo == 0 or ids[lo - 1] != frame_token:
                raise ValueError(f"row {b}: image {m} at token {lo} has no frame token <|vision_start|> before it")
            frame = lo - 1
            for i in range(cursor, frame):
                new_ids.append(ids[i]); new_pos.append(pos[:, i]); group.append(-1); copy.append(False); keep.append(i)
            start = int(pos[0, lo])  # the image's first token: t = h = w = start
            for k, tok in enumerate(prefix):
                new_ids.append(tok)
                new_pos.append(torch.full((3,), start - len(prefix) + k, dtype=pos.dtype))
                group.append(m); copy.append(True); keep.append(-1)
            new_ids.append(ids[frame]); new_pos.append(pos[:, frame]); group.append(-1); copy.append(False); keep.append(frame)
            for i in range(lo, hi):
                new_ids.append(ids[i]); new_pos.append(pos[:, i]); group.append(m); copy.append(False); keep.append(i)
            cursor = hi
        for i in range(cursor, n):
            new_ids.append(ids[i]); new_pos.append(pos[:, i]); group.append(-1); copy.append(False); keep.append(i)
        rows.append((new_ids, torch.stack(new_pos, dim=1), group, copy, keep))
    length = max(len(r[0]) for r in rows)
    B = len(rows)
    pad = getattr(text, "pad_token_id", None) or 0
    ids_t = torch.full((B, length), pad, dtype=input_ids.dtype)
    pos_t = torch.zeros((3, B, length), dtype=positions.dtype)
    group_t = torch.full((B, length), -2, dtype=torch.long)  # -2: padding
    copy_t = torch.zeros((B, length), dtype=torch.bool)
    labels = batch.get("labels")
    weights = batch.get("loss_weights")
    labels_t = torch.full((B, length), -100, dtype=torch.long) if labels is not None else None
    weights_t = torch.zeros((B, length), dtype=torch.float32) if weights is not None else None
    for b, (ids, pos, group, copy, keep) in enumerate(rows):
        L = len(ids)
        ids_t[b, :L] = torch.tensor(ids, dtype=input_ids.dtype)
        pos_t[:, b, :L] = pos
        group_t[b, :L] = torch.tensor(group)
        copy_t[b, :L] = torch.tensor(copy)
        src = torch.tensor(keep)
        real = src >= 0
        if labels_t is not None:
            labels_t[b, :L][real] = labels[b, src[real]]
        if weights_t is not None:
            weights_t[b, :L][real] = weights[b, src[real]]
    out["input_ids"], out["position_ids"] = ids_t, pos_t
    if labels_t is not None:
        out["labels"] = labels_t
    if weights_t is not None:
        out["loss_weights"] = weights_t
    if "mm_token_type_ids" in out:
        out["mm_token_type_ids"] = (ids_t == image_token).to(batch["mm_token_type_ids"].dtype)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    q_group, k_group = group_t[:, :, None], group_t[:, None, :]
    q_copy, k_copy = copy_t[:, :, None], copy_t[:, None, :]
    q_image = (group_t >= 0)[:, :, None] & ~q_copy
    in_context = causal & ~k_copy & ~q_copy  # text (and in-context image) queries: every non-copy key before
    own = causal & (q_group == k_group) & (k_group >= 0)  # an image's (or a copy's) own segment
    isolated_mask = torch.where(q_image | q_copy, own, in_context)
    context_mask = torch.where(q_copy, own, in_context)
    dtype = model.dtype
    low = torch.finfo(dtype).min
    masks = {}
    out["layer_masks"] = []
    for layer in range(num_layers):
        iso = attention.isolated_at(layer, num_layers)
        if iso not in masks:
            allowed = isolated_mask if iso else context_mask
            masks[iso] = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, low)[:, None]
        out["layer_masks"].append(masks[iso])
    out["attention_mask"] = None
    return out


@contextlib.contextmanager
def layer_masks(model, masks: Sequence[torch.Tensor] | None) -> Iterator[None]:
    """Within the block, decoder layer ``l`` of ``model`` attends with ``masks[l]`` (an additive
    4-D mask) instead of the mask the model builds; None: the model's own."""
    if masks is None:
        yield
        return
    layers = _base(model).model.language_model.layers
    if len(masks) != len(layers):
        raise ValueError(f"{len(masks)} layer masks for {len(layers)} decoder layers")
    handles = []
    for layer, mask in zip(layers, masks):
        def hook(module, args, kwargs, mask=mask):
            kwargs["attention_mask"] = mask.to(kwargs["hidden_states"].device if "hidden_states" in kwargs
                                               else args[0].device)
            return args, kwargs
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def forward_logits(model, batch: dict, attention: ImageAttention) -> tuple[torch.Tensor, dict]:
    """Logits [B, L', vocab] of ``batch`` under ``attention`` and the rewritten batch (its
    ``labels``/``loss_weights`` aligned with the logits)."""
    iso = isolate_batch(model, batch, attention)
    device = model.device
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in iso.items()
              if k not in ("labels", "loss_weights", "layer_masks")}
    masks = iso["layer_masks"]
    if masks is not None:
        # Any 4-D mask keeps the model from building its own; the hooks put each layer's in place.
        inputs["attention_mask"] = {"full_attention": masks[0].to(device)}
    with layer_masks(model, None if masks is None else [m.to(device) for m in masks]):
        logits = model(**inputs).logits
    return logits, iso


@torch.no_grad()
def greedy_reply(model, processor, messages: list[dict], attention: ImageAttention, max_new_tokens: int) -> str:
    """A greedy reply to ``messages`` (samcache chat messages, images as arrays) under
    ``attention``, decoded with the masked forward of the whole sequence at every step (no KV
    cache): slow, but defined for every variant, the ones no engine serves included."""
    import numpy as np
    from PIL import Image

    from samcache.engine.prompt import normalize_messages

    chat, images = normalize_messages(messages)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    batch = dict(processor(text=[text], images=[Image.fromarray(np.asarray(im)) for im in images] or None,
                           return_tensors="pt"))
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits, _ = forward_logits(model, batch, attention)
        token = int(logits[0, -1].argmax())
        if token == end:
            break
        out.append(token)
        grow = torch.tensor([[token]], dtype=batch["input_ids"].dtype)
        batch["input_ids"] = torch.cat([batch["input_ids"], grow], dim=1)
        batch["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones_like(grow)], dim=1)
        batch["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(grow).to(
            batch["mm_token_type_ids"].dtype)], dim=1)
    return processor.tokenizer.decode(out, skip_special_tokens=True)


__all__ = ["IMAGE_MARKUP", "LINK_TOKEN", "VISION_IDS_DEFAULT", "enable_link_tokens", "enable_vision_ids",
           "forward_logits", "greedy_reply", "isolate_batch", "layer_masks", "link_tokens", "vision_ids_enabled"]
