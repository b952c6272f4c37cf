"""Train a tiny Qwen2.5-VL on the visual QA task family (:mod:`samcache.tasks.visual_qa`), on CPU,
reproducibly from a seed.

The model is the real architecture (``Qwen2_5_VLForConditionalGeneration``) built by
:func:`samcache.random_checkpoints.build_tiny_model` with the project's tokenizer, so every engine that loads a
Hugging Face checkpoint loads the result. Training is plain next-token cross-entropy on the
assistant's reply only (the prompt and the images are context), AdamW with warm-up and cosine
decay, a curriculum from one image to several, and dense supervision on part of the examples (the
reply first describes every element of every image, then answers). Held-out accuracy is greedy
decoding of the reply compared with the answer.

Training has two stages. The **vision stage** (:func:`train_vision`) trains the vision tower alone
for ``vision_steps``: linear probes on its merged output tokens classify what is under each token
(colour, kind, label or nothing), and are thrown away afterwards. The **language stage** then
trains the whole model on the chat examples. Why: through the language model, the gradient that
reaches the vision tower is too weak to teach it, within an hour, to read 5-pixel labels or to know
where a token lies in the image (which the language model cannot tell from relative positions
alone): held-out accuracy stayed near 30-40% after 36,000 examples, half of the cells named wrong.
The probes teach both in about 1,500 steps (3 minutes): 100% of colours, kinds and cells and
about 96% of labels per token (docs/benchmark.md).

    python -m samcache.tasks.training --out models/visual-qa --steps 3000 --seed 0

Why this module is long: the two stages share one configuration, one example encoding and one
held-out evaluation, and a run continued from another (``--init``, ``--deepen``) must read what
the earlier run wrote; split apart, each part would import the others.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from samcache._checks import check_int
from samcache.profile.image_attention import CAUSAL, CONFIG_KEY, ImageAttention
from samcache.tasks.image_isolation import enable_link_tokens, enable_vision_ids, forward_logits, link_tokens

#: The model trained by default: 4 text layers of hidden 256 (4 heads over 2 KV heads of 64
#: dims), a 4-block vision tower of hidden 128.
MODEL_SIZES: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, fullatt_block_indexes=[1, 3]),
)


def model_sizes_of(model_config) -> dict[str, Any]:
    """The :data:`MODEL_SIZES` entries of a loaded model's config (text and vision)."""
    text = getattr(model_config, "text_config", model_config)
    vision = model_config.vision_config
    return {**{k: getattr(text, k) for k in MODEL_SIZES if k != "vision_config"},
            "vision_config": {k: getattr(vision, k) for k in MODEL_SIZES["vision_config"]}}


@dataclass
class TrainConfig:
    """``steps`` optimizer steps of ``batch_size`` examples; ``curriculum``: (most images per
    example, share of the steps) in order, each stage drawing 1 to that many images; ``dense_fraction``: share of examples whose reply describes
    every element first (the held-out questions ask for that when ``dense_eval``);
    ``vision_steps`` of ``vision_batch_size`` images at ``vision_lr`` train the vision tower first
    (:func:`train_vision`), which then learns at ``vision_lr_scale`` times ``lr``;
    ``answer_weight``: the loss weight of the answer's tokens, with ``evidence`` from the
    'Found:' line on (1 for the description's);
    ``evidence``: dense replies repeat the part of the description that holds the answer before
    it, keys first (:func:`samcache.tasks.visual_qa.evidence_line`);
    ``init_from``: an earlier run to continue (its weights, and the train examples after those it
    saw; set ``vision_steps=0``); ``image_attention``: how image tokens attend
    (:class:`samcache.profile.image_attention.ImageAttention`, by name), declared in the written
    checkpoint; ``vision_ids``: the chat template writes "Picture k: " before each image, so an
    isolated image's index is in the text; ``deepen``: decoder layers added on top of that run's
    (:func:`deepen_checkpoint`); ``device``: where the model trains (``"cuda"`` on a GPU: the same
    steps and examples, minutes instead of hours; the weights are written the same way).

    Why dense by default, and 84x84 images (a 3x3 grid of image tokens, one per cell of the
    task's 3x3 grid): trained on the answers alone, this model stayed at chance on single-image
    colour questions after 32,000 examples (12.5%, 8 colours); describing every element first, it
    reached 53% after 7,200 (docs/benchmark.md)."""

    seed: int = 0
    steps: int = 3000
    stop_after: int | None = None  # stop (and write the weights) after this many steps of a ``steps`` schedule
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    curriculum: tuple[tuple[int, float], ...] = ((1, 0.4), (2, 0.2), (4, 0.4))
    vision_steps: int = 1500
    vision_batch_size: int = 32
    vision_lr: float = 1e-3
    vision_lr_scale: float = 0.1
    dense_fraction: float = 1.0
    answer_weight: float = 20.0
    framed: bool = True
    evidence: bool = False
    init_from: str | None = None
    deepen: int = 0
    dense_eval: bool = True
    kind: str = "gui"
    size: tuple[int, int] = (84, 84)
    eval_every: int = 500
    eval_examples: int = 64
    threads: int = 2
    device: str = "cpu"
    image_attention: str = "causal"  # how images attend (ImageAttention.parse): causal, isolated, ...
    vision_ids: bool = False  # "Picture k: " before each image (the chat template's add_vision_id, on by default)
    link_tokens: int = 0  # link tokens the chat template writes after each image (in context, always computed)
    model_sizes: dict[str, Any] = field(default_factory=lambda: dict(MODEL_SIZES))

    def images_at(self, step: int) -> int:
        """Images per example at ``step`` (the curriculum stage it falls in)."""
        total = sum(share for _, share in self.curriculum)
        edge = 0.0
        for images, share in self.curriculum:
            edge += share / total * self.steps
            if step < edge:
                return images
        return self.curriculum[-1][0]


def _chat(msgs: list[dict]) -> tuple[list[dict], list[Any]]:
    """samcache's messages (image parts hold pixel arrays) as the processor's chat template takes
    them, and the images in order."""
    chat, images = [], []
    for m in msgs:
        if isinstance(m["content"], str):
            chat.append({"role": m["role"], "content": [{"type": "text", "text": m["content"]}]})
            continue
        parts = []
        for part in m["content"]:
            if part.get("type") == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        chat.append({"role": m["role"], "content": parts})
    return chat, images


def _answer_tail(reply: str) -> str:
    """The part of a reply that is the answer: from the last 'Answer:' on (all of it without one),
    or from the 'Found:' line before it where the reply has one (``evidence``): that line is the
    lookup the model gets wrong when its descriptions are already right (docs/benchmark.md)."""
    at = reply.rfind("Answer:")
    if at < 0:
        return reply
    found = reply.rfind("Found:", 0, at)
    return reply[found if found >= 0 else at:]


def encode_batch(processor, batch: Sequence[list[dict]], answer_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Model inputs of conversations (right-padded) with labels on every assistant reply and its
    end-of-turn token; the prompt, the images and the padding are context only. ``loss_weights``
    weighs each label: ``answer_weight`` on the answer ('Answer: ...' and the end-of-turn token;
    from 'Found: ...' on where the reply has an evidence line), 1 on the rest of the reply (the
    description)."""
    from PIL import Image

    texts, images, tails = [], [], []
    tok = processor.tokenizer
    for msgs in batch:
        chat, ims = _chat(msgs)
        texts.append(processor.apply_chat_template(chat, tokenize=False))
        images.extend(Image.fromarray(np.asarray(im)) for im in ims)
        replies = [m["content"] if isinstance(m["content"], str) else "".join(p.get("text", "") for p in m["content"])
                   for m in msgs if m["role"] == "assistant"]
        tails.append([len(tok(_answer_tail(r), add_special_tokens=False)["input_ids"]) + 1 for r in replies])
    enc = processor(text=texts, images=images or None, padding=True, padding_side="right", return_tensors="pt")
    tok = processor.tokenizer
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    labels = torch.full_like(enc["input_ids"], -100)
    weights = torch.zeros(enc["input_ids"].shape, dtype=torch.float32)
    for i, ids in enumerate(enc["input_ids"].tolist()):
        j, span = 0, 0
        while j + len(header) <= len(ids):
            if ids[j:j + len(header)] != header:
                j += 1
                continue
            start = j = j + len(header)
            while j < len(ids) and ids[j] != end:
                j += 1
            labels[i, start:j + 1] = enc["input_ids"][i, start:j + 1]
            weights[i, start:j + 1] = 1.0
            tail = tails[i][span] if span < len(tails[i]) else 0
            weights[i, max(start, j + 1 - tail):j + 1] = answer_weight
            span += 1
    enc["labels"] = labels
    enc["loss_weights"] = weights
    return dict(enc)


def _on(device: torch.device, tensors: dict) -> dict:
    """``tensors`` (a processor's output) moved to ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def weighted_loss(model, inputs: dict[str, torch.Tensor], attention: ImageAttention = CAUSAL) -> torch.Tensor:
    """Next-token cross-entropy over the labelled tokens, each weighted by ``loss_weights``, with
    image tokens attending as ``attention`` says."""
    logits, iso = forward_logits(model, inputs, attention)
    logits = logits[:, :-1].float()
    target, w = iso["labels"][:, 1:].to(logits.device), iso["loss_weights"][:, 1:].to(logits.device)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           ignore_index=-100, reduction="none").view_as(w)
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


@torch.no_grad()
def evaluate(model, processor, examples: Sequence[Any], make_messages, *, dense: bool = False,
             max_new_tokens: int | None = None, replies: bool = False) -> dict:
    """Greedy-decoded replies against the answers: accuracy over ``examples``. ``dense``: the
    question asks the model to describe every element first, the answer follows 'Answer:'.
    ``replies``: also return the replies themselves (``"replies"``, in the examples' order)."""
    from PIL import Image

    from samcache.tasks.visual_qa import dense_token_budget, is_correct

    if not isinstance(replies, bool):
        raise TypeError(f"replies must be a bool, got {replies!r}")
    model.eval()
    correct, texts = 0, []
    for ex in examples:
        chat, ims = _chat(make_messages(ex, dense=dense, answer=False))
        budget = max_new_tokens or (dense_token_budget(len(ims)) if dense else 6)
        enc = processor(text=[processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)],
                        images=[Image.fromarray(np.asarray(im)) for im in ims] or None, return_tensors="pt")
        out = model.generate(**_on(model.device, enc), max_new_tokens=budget, do_sample=False)
        reply = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += is_correct(reply, ex.answer)
        texts.append(reply)
    model.train()
    out = {"accuracy": correct / max(1, len(examples)), "examples": len(examples)}
    return {**out, "replies": texts} if replies else out


@torch.no_grad()
def teacher_forced(model, processor, conversations: Sequence[list[dict]], attention: ImageAttention = CAUSAL, *,
                   batch_size: int = 8) -> dict:
    """Each reply of ``conversations`` (chat messages with their assistant replies) teacher-forced
    under ``attention``: ``answers``, the share of replies whose answer part (from 'Found:' on, or
    'Answer:', and the end-of-turn token) is predicted right token for token; ``description_tokens``,
    the share of the other reply tokens predicted right. Cheap (one forward per batch) and defined
    for any image attention, where greedy decoding through Hugging Face's ``generate`` is not."""
    was_training = model.training
    model.eval()
    answers = replies = desc_right = desc_total = 0
    for at in range(0, len(conversations), batch_size):
        batch = encode_batch(processor, conversations[at:at + batch_size], answer_weight=2.0)
        logits, iso = forward_logits(model, batch, attention)
        right = (logits[:, :-1].argmax(-1).cpu() == iso["labels"][:, 1:])
        w = iso["loss_weights"][:, 1:]
        desc = w == 1.0
        desc_right += int((right & desc).sum())
        desc_total += int(desc.sum())
        tail = (w == 2.0).int()
        for b in range(tail.shape[0]):  # each run of answer-part tokens is one reply's answer
            edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int), tail[b], torch.zeros(1, dtype=torch.int)]))
            for lo, hi in zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()):
                replies += 1
                answers += bool(right[b, lo:hi].all())
    model.train(was_training)
    return {"answers": answers / max(1, replies), "replies": replies,
            "description_tokens": desc_right / max(1, desc_total)}


def held_out_conversations(config: "TrainConfig", num_images: int, count: int) -> list[list[dict]]:
    """``count`` held-out dense conversations (the test seed stream) framed as training frames them."""
    from samcache.tasks import visual_qa as task

    exs = task.examples("test", count, num_images=num_images, kind=config.kind, size=config.size, seed=config.seed)
    return [task.framed_messages(ex, i, dense=True, evidence=config.evidence) for i, ex in enumerate(exs)]


#: What the vision-stage probes classify for each merged image token: the colour, kind and label of
#: the element under it (class 0: none) and the grid cell it lies in (class 0: between cells).
PROBED_ATTRIBUTES = ("colour", "kind", "label", "cell")


def _token_cells(size: tuple[int, int], grid: tuple[int, int]) -> list[str | None]:
    """For each merged image token of a ``grid`` (rows, cols) over an image of ``size``, raster
    order: the 3x3 cell that holds the token's centre (None between cells)."""
    from samcache.tasks.visual_qa import CELLS, cell_box

    h, w = size
    rows, cols = grid
    out = []
    for r in range(rows):
        for c in range(cols):
            y, x = (r + 0.5) * h / rows, (c + 0.5) * w / cols
            out.append(next((cell for cell in CELLS if (lambda b: b[0] <= x < b[2] and b[1] <= y < b[3])(cell_box(size, cell))), None))
    return out


def _probe_targets(spec, cells: Sequence[str | None]) -> dict[str, list[int]]:
    from samcache.tasks import visual_qa as task

    values = {"colour": list(task.COLOURS), "kind": list(task.KINDS), "label": list(task.LABELS)}
    out: dict[str, list[int]] = {a: [] for a in PROBED_ATTRIBUTES}
    for cell in cells:
        element = spec.element_at(cell) if cell is not None else None
        for a in values:
            out[a].append(0 if element is None else 1 + values[a].index(getattr(element, a)))
        out["cell"].append(0 if cell is None else 1 + task.CELLS.index(cell))
    return out


def train_vision(model, processor, config: TrainConfig, *, progress: bool = True) -> list[dict]:
    """The vision stage: ``config.vision_steps`` steps of the vision tower with linear probes on its
    merged tokens (one per attribute in PROBED_ATTRIBUTES), on single GUI screenshots from the
    train seed stream (the language stage draws its own, later ones). Returns the probes' held-out
    accuracy over tokens that show an element, every ``config.eval_every`` steps."""
    from PIL import Image
    from tqdm import tqdm

    from samcache.tasks import visual_qa as task

    if config.kind != "gui":
        raise ValueError(f"the vision stage probes GUI elements; kind={config.kind!r} needs vision_steps=0")
    visual = model.model.visual
    hidden = visual.merger.mlp[-1].out_features
    sizes = {"colour": len(task.COLOURS), "kind": len(task.KINDS), "label": len(task.LABELS), "cell": len(task.CELLS)}
    device = model.device
    probes = torch.nn.ModuleDict({a: torch.nn.Linear(hidden, sizes[a] + 1) for a in PROBED_ATTRIBUTES}).to(device)
    optimizer = torch.optim.AdamW([*visual.parameters(), *probes.parameters()], lr=config.vision_lr,
                                  weight_decay=config.weight_decay)
    merge = visual.spatial_merge_size

    def batch(first: int, n: int, split: str):
        exs = [task.make_example(task.split_seed(split, first + i, config.seed), num_images=1, kind="gui",
                                 size=config.size) for i in range(n)]
        enc = processor.image_processor(images=[Image.fromarray(np.asarray(ex.images[0])) for ex in exs],
                                        return_tensors="pt")
        targets = {a: [] for a in PROBED_ATTRIBUTES}
        for ex, (_, gh, gw) in zip(exs, enc["image_grid_thw"].tolist()):
            for a, v in _probe_targets(ex.specs[0], _token_cells(config.size, (gh // merge, gw // merge))).items():
                targets[a].extend(v)
        return _on(device, enc), {a: torch.tensor(v, device=device) for a, v in targets.items()}

    def accuracy() -> dict:
        with torch.no_grad():
            enc, targets = batch(0, config.eval_examples, "test")
            feats = visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]).pooler_output
            shown = targets["kind"] > 0
            return {f"{a}_accuracy": (probes[a](feats).argmax(-1) == targets[a])[shown].float().mean().item()
                    for a in PROBED_ATTRIBUTES}

    curve, start = [], time.perf_counter()
    bar = tqdm(range(config.vision_steps), desc="vision stage", disable=not progress)
    for step in bar:
        # The train stream from the far end, so the language stage's examples are other screenshots.
        enc, targets = batch(10**9 + step * config.vision_batch_size, config.vision_batch_size, "train")
        feats = visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]).pooler_output
        loss = sum(torch.nn.functional.cross_entropy(probes[a](feats), targets[a]) for a in PROBED_ATTRIBUTES)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % config.eval_every == 0 or step + 1 == config.vision_steps:
            point = {"step": step + 1, "loss": loss.item(), "seconds": time.perf_counter() - start, **accuracy()}
            curve.append(point)
            bar.write(json.dumps(point))
    return curve


def _copy_run(src: pathlib.Path, out: pathlib.Path) -> int:
    """Copy the checkpoint of run ``src`` into ``out``; the number of examples it was trained on."""
    import shutil

    report = src / "training.json"
    if not (src / "model.safetensors").is_file() or not report.is_file():
        raise ValueError(f"init_from={str(src)!r} is not a training run (model.safetensors and training.json needed)")
    if src.resolve() != out.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.name != "training.json":
                shutil.copyfile(f, out / f.name)
    earlier = json.loads(report.read_text())
    last = (earlier.get("curve") or [{}])[-1]
    return int(last.get("examples_seen", 0)) + int(earlier.get("config", {}).get("first_example", 0))


def deepen_checkpoint(path, extra: int) -> None:
    """Add ``extra`` decoder layers on top of a checkpoint's language model, in place: each a copy
    of the last layer with its output projections (``o_proj``, ``down_proj``) zeroed, so the
    model computes exactly what it did (the new layers add nothing to the residual stream) and
    training gives them work. Why: the 4-layer model describes 4 screenshots right 87% of the time
    but picks the element a question names out of them only 29% of the time (docs/benchmark.md),
    a lookup that needs more attention layers, not a better vision tower."""
    import copy

    from samcache.random_checkpoints import model_class

    check_int("extra", extra, 1)
    model = model_class("qwen2_5_vl").from_pretrained(path, dtype=torch.float32)
    text = model.config.text_config
    layers = model.model.language_model.layers
    for _ in range(extra):
        layer = copy.deepcopy(layers[-1])
        layer.self_attn.layer_idx = len(layers)
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            torch.nn.init.zeros_(proj.weight)
            if proj.bias is not None:
                torch.nn.init.zeros_(proj.bias)
        layers.append(layer)
    text.num_hidden_layers = len(layers)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types) + [text.layer_types[-1]] * extra
    model.save_pretrained(path)


def train(out_dir, config: TrainConfig | None = None, *, progress: bool = True) -> dict:
    """Train from ``config.seed`` and write the checkpoint (float32 safetensors + processor) and
    ``training.json`` (the config and the accuracy curve) to ``out_dir``."""
    from tqdm import tqdm

    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import build_tiny_model, model_class
    from samcache.tasks import visual_qa as task

    config = config or TrainConfig()
    check_int("steps", config.steps, 1)
    check_int("batch_size", config.batch_size, 1)
    check_int("vision_steps", config.vision_steps, 0)
    if config.stop_after is not None:
        check_int("stop_after", config.stop_after, 1)
        if config.stop_after > config.steps:
            raise ValueError(f"stop_after ({config.stop_after}) must not exceed steps ({config.steps})")
    if not config.answer_weight > 0:
        raise ValueError(f"answer_weight must be > 0, got {config.answer_weight!r}")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is visible")
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = pathlib.Path(out_dir)
    seen = 0
    if config.init_from is None:
        build_tiny_model("qwen2_5_vl", out, seed=config.seed, **config.model_sizes)
    else:  # continue an earlier run: its weights, and examples after the ones it saw
        seen = _copy_run(pathlib.Path(config.init_from), out)
        if config.deepen:
            deepen_checkpoint(out, config.deepen)
    attention = ImageAttention.parse(config.image_attention)
    if config.vision_ids:
        enable_vision_ids(out)
    if config.link_tokens and link_tokens(out) != config.link_tokens:
        enable_link_tokens(out, config.link_tokens)
    model = model_class("qwen2_5_vl").from_pretrained(out, dtype=torch.float32).to(device).train()
    attention.check_depth(model.config.text_config.num_hidden_layers)
    # The checkpoint declares how its images attend (every save writes the config).
    if attention.isolated:
        setattr(model.config, CONFIG_KEY, attention.to_dict())
    elif hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    if config.init_from is not None:  # training.json records the model trained, not the defaults
        config.model_sizes = model_sizes_of(model.config)
    processor = load_processor(out)
    vision_curve = train_vision(model, processor, config, progress=progress) if config.vision_steps else []
    visual = set(map(id, model.model.visual.parameters()))
    groups = [{"params": [p for p in model.parameters() if id(p) not in visual]},
              {"params": list(model.model.visual.parameters()), "lr": config.lr * config.vision_lr_scale}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / config.warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / config.steps))))
    rng = np.random.default_rng(config.seed)  # which examples get dense replies
    held_out = {n: list(task.examples("test", config.eval_examples, num_images=n, kind=config.kind,
                                      size=config.size, seed=config.seed)) for n in (1, 4)}
    forced = {n: held_out_conversations(config, n, config.eval_examples) for n in (1, 4)} if config.dense_eval else {}
    curve, start = [], time.perf_counter()
    first_example = seen
    last = config.stop_after or config.steps
    bar = tqdm(range(last), desc="training", disable=not progress)
    for step in bar:
        n = config.images_at(step)
        batch = []
        for _ in range(config.batch_size):
            # A stage mixes every image count up to its own: trained on 2-image examples alone, the
            # model described two screenshots whatever it was shown (docs/benchmark.md).
            images = int(rng.integers(1, n + 1))
            # The train seed stream never meets the test one (task.split_seed).
            ex = task.make_example(task.split_seed("train", seen, config.seed), num_images=images, kind=config.kind,
                                   size=config.size)
            dense = bool(rng.random() < config.dense_fraction)
            # Framed as the traces send it (system prompts, step numbers, follow-up turns), so the
            # model answers them too.
            batch.append(task.framed_messages(ex, int(rng.integers(2**31)), dense=dense, evidence=config.evidence)
                         if config.framed else task.messages(ex, dense=dense, evidence=config.evidence))
            seen += 1
        loss = weighted_loss(model, encode_batch(processor, batch, config.answer_weight), attention)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", images=n)
        if (step + 1) % config.eval_every == 0 or step + 1 == last:
            point = {"step": step + 1, "examples_seen": seen - first_example, "loss": loss.item(),
                     "seconds": time.perf_counter() - start}
            if not attention.isolated:  # greedy decoding through generate() is causal attention only
                for k, exs in held_out.items():
                    point[f"accuracy_{k}_image"] = evaluate(model, processor, exs, task.messages,
                                                            dense=config.dense_eval)["accuracy"]
            for k, convs in forced.items():
                scores = teacher_forced(model, processor, convs, attention)
                point[f"forced_answers_{k}_image"] = scores["answers"]
                point[f"forced_description_{k}_image"] = scores["description_tokens"]
            curve.append(point)
            bar.write(json.dumps(point))
            model.save_pretrained(out)  # the latest weights are on disk at every evaluation
            (out / "training.json").write_text(json.dumps({"config": {**asdict(config), "first_example": first_example},
                                                           "vision_curve": vision_curve, "curve": curve}, indent=2))
    model.save_pretrained(out)
    report = {"config": {**asdict(config), "first_example": first_example}, "vision_curve": vision_curve, "curve": curve}
    (out / "training.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--stop-after", type=int, default=None, metavar="N",
                        help="stop after N steps of the --steps learning-rate schedule (then --init a run from it)")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--eval-examples", type=int, default=TrainConfig.eval_examples)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
    parser.add_argument("--device", default=TrainConfig.device, help="cpu (default) or cuda")
    parser.add_argument("--images", type=int, nargs="+", default=None,
                        help="curriculum: images per example of each stage, equal shares (default 1 2 4)")
    parser.add_argument("--vision-steps", type=int, default=TrainConfig.vision_steps,
                        help="steps of the vision stage (0: none)")
    parser.add_argument("--init", default=None, metavar="RUN",
                        help="continue from this training run's weights (use with --vision-steps 0)")
    parser.add_argument("--deepen", type=int, default=0, metavar="N",
                        help="with --init: add N decoder layers on top (zero output projections: same outputs)")
    parser.add_argument("--evidence", action="store_true",
                        help="dense replies repeat the element that holds the answer before answering")
    parser.add_argument("--answer-weight", type=float, default=TrainConfig.answer_weight,
                        help="loss weight of the answer tokens against 1 for the description")
    parser.add_argument("--dense-fraction", type=float, default=TrainConfig.dense_fraction)
    parser.add_argument("--image-size", type=int, nargs=2, default=list(TrainConfig.size), metavar=("H", "W"))
    parser.add_argument("--image-attention", default=TrainConfig.image_attention, metavar="NAME",
                        help="how image tokens attend: causal (default), isolated (with a sink), isolated-nosink, "
                             "isolated-top<k> (top k layers in context); declared in the checkpoint")
    parser.add_argument("--vision-ids", action="store_true",
                        help='"Picture k: " before each image (the chat template\'s add_vision_id, made its default)')
    parser.add_argument("--link-tokens", type=int, default=0, metavar="N",
                        help="the chat template writes N link tokens after each image (text: in context, always "
                             "computed; they bind an isolated image to its place)")
    parser.add_argument("--layers", type=int, default=MODEL_SIZES["num_hidden_layers"],
                        help="decoder layers of a new model (ignored with --init)")
    parser.add_argument("--heads", type=int, default=MODEL_SIZES["num_attention_heads"],
                        help="attention heads of a new model (head_dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=MODEL_SIZES["num_key_value_heads"],
                        help="key/value heads of a new model")
    args = parser.parse_args(argv)
    config = TrainConfig(seed=args.seed, steps=args.steps, stop_after=args.stop_after, batch_size=args.batch_size, lr=args.lr,
                         eval_every=args.eval_every, eval_examples=args.eval_examples, threads=args.threads,
                         vision_steps=args.vision_steps, dense_fraction=args.dense_fraction,
                         answer_weight=args.answer_weight, init_from=args.init, deepen=args.deepen, evidence=args.evidence, dense_eval=args.dense_fraction > 0,
                         size=tuple(args.image_size), device=args.device,
                         image_attention=ImageAttention.parse(args.image_attention).name, vision_ids=args.vision_ids,
                         link_tokens=args.link_tokens)
    config.model_sizes.update(num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.kv_heads)
    if args.images:
        config.curriculum = tuple((n, 1.0) for n in args.images)
    train(args.out, config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
