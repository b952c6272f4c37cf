"""``samcache adapt``: fine-tune an existing Qwen2.5-VL-style checkpoint to isolated image attention.

The result declares its image attention (config.json), renders "Picture k: " before each image
(its chat template), and carries its reuse profile, so samcache's engine serves it with every image
computed once alone and reused at any index, exactly (docs/design.md, "Image-isolated attention").
Training computes what serving computes: the Hugging Face forward with explicit per-layer masks of
:mod:`samcache.tasks.image_isolation`.

Data: the synthetic visual-QA tasks (``--data synthetic``: framed multi-image examples from the
train seed stream, dense replies as the model was trained on) or a JSONL file of conversations, one
``{"messages": [...]}`` per line in samcache's chat format, images as paths relative to the file;
every assistant turn is a target. Fully (default) or with LoRA adapters (``--lora-rank R``, peft),
merged into the weights at the end. The state is saved every ``--save-every`` steps; ``--resume``
continues a run from it, and gives the same weights as a run that was never stopped.

    samcache adapt python/samcache/tasks/checkpoints/visual-qa --out runs/adapted --steps 900
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from samcache._checks import check_int
from samcache.profile.image_attention import CONFIG_KEY, ImageAttention
from samcache.tasks.image_isolation import enable_link_tokens, enable_vision_ids, link_tokens
from samcache.tasks.training import encode_batch, teacher_forced, weighted_loss

STATE = "adapt_state.pt"
RECORD = "adapt.json"
#: The language model's projections LoRA adapts (attention and MLP of every decoder layer).
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass
class AdaptConfig:
    """``steps`` optimizer steps of ``batch_size`` conversations at ``lr`` (warm-up, cosine decay);
    ``lora_rank`` 0 fine-tunes every weight (the vision tower at a tenth of ``lr``), R > 0 trains
    rank-R adapters on the language model only; ``link_tokens``: the chat template writes that many
    link tokens after each image (in context, always computed); ``answer_weight``: the loss weight of the answer
    part of synthetic replies; ``eval_every`` / ``eval_examples``: teacher-forced held-out scores
    (synthetic data); ``save_every``: the resumable state."""

    image_attention: str = "isolated"
    link_tokens: int = 0
    data: str = "synthetic"
    steps: int = 900
    batch_size: int = 16
    lr: float = 3e-4
    warmup: int = 50
    lora_rank: int = 0
    lora_alpha: float | None = None
    answer_weight: float = 4.0
    eval_every: int = 150
    eval_examples: int = 48
    save_every: int = 50
    seed: int = 0
    threads: int = 2
    device: str = "cpu"

    def check(self) -> ImageAttention:
        attention = ImageAttention.parse(self.image_attention)
        if not attention.isolated:
            raise ValueError(f"--image-attention {self.image_attention!r}: adapt trains isolated image attention")
        for name, minimum in (("steps", 1), ("batch_size", 1), ("warmup", 0), ("lora_rank", 0), ("link_tokens", 0),
                              ("eval_every", 1),
                              ("eval_examples", 0), ("save_every", 1), ("threads", 1), ("seed", 0)):
            check_int(f"--{name.replace('_', '-')}", getattr(self, name), minimum)
        for name in ("lr", "answer_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {value!r}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha!r}")
        return attention


# ---- data ---------------------------------------------------------------------------------------
class SyntheticData:
    """Framed dense visual-QA conversations (1 to 4 images) from the train seed stream, past the
    examples the base checkpoint was trained on; example ``i`` is a function of ``i`` alone."""

    def __init__(self, base: pathlib.Path, seed: int) -> None:
        from samcache.bench.task_accuracy import training_defaults

        trained = training_defaults(base)
        self.size = tuple(trained.get("size", (84, 84)))
        record = base / "training.json"
        config = json.loads(record.read_text()).get("config", {}) if record.is_file() else {}
        curve = json.loads(record.read_text()).get("curve", []) if record.is_file() else []
        self.first = int(config.get("first_example", 0)) + int((curve or [{}])[-1].get("examples_seen", 0))
        self.evidence = bool(config.get("evidence", True))
        self.seed = seed

    def conversation(self, i: int) -> list[dict]:
        from samcache.tasks import visual_qa as task

        rng = np.random.default_rng([self.seed, i])
        ex = task.make_example(task.split_seed("train", self.first + i, self.seed), num_images=int(rng.integers(1, 5)),
                               kind="gui", size=self.size)
        return task.framed_messages(ex, int(rng.integers(2**31)), dense=True, evidence=self.evidence)

    def held_out(self, num_images: int, count: int) -> list[list[dict]]:
        from samcache.tasks import visual_qa as task

        exs = task.examples("test", count, num_images=num_images, kind="gui", size=self.size, seed=self.seed)
        return [task.framed_messages(ex, i, dense=True, evidence=self.evidence) for i, ex in enumerate(exs)]


class JsonlData:
    """Conversations from a JSONL file, checked whole at start-up (every line a ``messages`` list,
    every image readable); each pass over them in a fresh seeded order."""

    def __init__(self, path: pathlib.Path, seed: int) -> None:
        from PIL import Image

        self.path, self.seed = path, seed
        self.records: list[list[dict]] = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--data {path}: cannot read it ({e})") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            msgs = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(msgs, list) or not msgs:
                raise ValueError(f'{where}: expected {{"messages": [...]}} with at least one message')
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs):
                raise ValueError(f"{where}: no assistant message to learn from")
            for m in msgs:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"{where}: each message needs a 'role' and a 'content'")
                for part in m["content"] if isinstance(m["content"], list) else []:
                    if isinstance(part, dict) and part.get("type") == "image":
                        image = part.get("image")
                        if not isinstance(image, str):
                            raise ValueError(f"{where}: an image part's 'image' must be a path, got {image!r:.60}")
                        file = (path.parent / image)
                        try:
                            with Image.open(file) as im:
                                im.verify()
                        except FileNotFoundError:
                            raise ValueError(f"{where}: image {image!r} not found (paths are relative to "
                                             f"{path.parent})") from None
                        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a bad file
                            raise ValueError(f"{where}: image {image!r} cannot be read ({e})") from None
                        part["image"] = str(file)
            self.records.append(msgs)
        if not self.records:
            raise ValueError(f"--data {path}: no conversations in it")

    def conversation(self, i: int) -> list[dict]:
        from PIL import Image

        n = len(self.records)
        order = np.random.default_rng([self.seed, i // n]).permutation(n)
        msgs = self.records[int(order[i % n])]
        out = []
        for m in msgs:
            content = m["content"]
            if isinstance(content, list):
                content = [{**p, "image": np.asarray(Image.open(p["image"]).convert("RGB"))}
                           if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
            out.append({"role": m["role"], "content": content})
        return out

    def held_out(self, num_images: int, count: int) -> list[list[dict]]:
        return []  # the user's data has no held-out split here


def _data(spec: str, base: pathlib.Path, seed: int):
    if spec == "synthetic":
        return SyntheticData(base, seed)
    path = pathlib.Path(spec)
    if path.suffix != ".jsonl":
        raise ValueError(f"--data must be 'synthetic' or a .jsonl file, got {spec!r}")
    return JsonlData(path, seed)


# ---- the run ------------------------------------------------------------------------------------
def _prepare_output(model: pathlib.Path, out: pathlib.Path) -> None:
    """Copy the base checkpoint's files into ``out`` (weights, config, processor, template)."""
    if not (model / "config.json").is_file():
        raise ValueError(f"{model} is not a checkpoint folder (no config.json)")
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.name not in ("SHA256SUMS", "samcache_profile.json", STATE, RECORD):
            shutil.copyfile(f, out / f.name)


def adapt(model, out, config: AdaptConfig | None = None, *, resume: bool = False, progress: bool = True) -> dict:
    """Fine-tune checkpoint ``model`` into ``out`` (see the module docstring); returns the record
    written to ``out/adapt.json`` (the configuration, the loss and held-out curve, the time)."""
    from tqdm import tqdm

    from samcache.engine.loading import load_processor
    from samcache.profile.reuse_profile import make_profile, write_profile
    from samcache.random_checkpoints import model_class

    config = config or AdaptConfig()
    attention = config.check()
    model, out = pathlib.Path(model), pathlib.Path(out)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    state_path = out / STATE
    state = None
    if resume:
        if not state_path.is_file():
            raise ValueError(f"--resume: {out} holds no saved state ({STATE}); start the run without --resume")
        state = torch.load(state_path, weights_only=False)
        if state["config"] != asdict(config):
            changed = sorted(k for k, v in asdict(config).items() if state["config"].get(k) != v)
            raise ValueError(f"--resume: the run was started with other settings ({', '.join(changed)})")
    data = _data(config.data, model, config.seed)  # bad data stops the run before anything is written
    if state is None:
        _prepare_output(model, out)
    enable_vision_ids(out)
    if config.link_tokens and link_tokens(out) != config.link_tokens:
        enable_link_tokens(out, config.link_tokens)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    net = model_class("qwen2_5_vl").from_pretrained(out, dtype=torch.float32)
    attention.check_depth(net.config.text_config.num_hidden_layers)
    setattr(net.config, CONFIG_KEY, attention.to_dict())
    saved_dtype = torch.float16 if "float16" in str(getattr(net.config, "dtype", "")) else torch.float32
    if config.lora_rank:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha or 2 * config.lora_rank,
                                             target_modules=LORA_TARGETS, lora_dropout=0.0))
        groups = [{"params": [p for p in net.parameters() if p.requires_grad]}]
    else:
        visual = set(map(id, net.model.visual.parameters()))
        groups = [{"params": [p for p in net.parameters() if id(p) not in visual]},
                  {"params": list(net.model.visual.parameters()), "lr": config.lr * 0.1}]
    net.to(device).train()
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, config.warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / config.steps))))
    processor = load_processor(out)
    start, curve, seconds = 0, [], 0.0
    if state is not None:
        trainable = {n: p for n, p in net.named_parameters() if p.requires_grad}
        with torch.no_grad():
            for name, value in state["weights"].items():
                trainable[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start, curve, seconds = state["step"], state["curve"], state["seconds"]
    held = {n: data.held_out(n, config.eval_examples) for n in (1, 4)} if config.eval_examples else {}
    held = {n: c for n, c in held.items() if c}

    def save_state(step: int) -> None:
        weights = {n: p.detach().cpu().clone() for n, p in net.named_parameters() if p.requires_grad}
        tmp = state_path.with_suffix(".tmp")
        torch.save({"config": asdict(config), "step": step, "weights": weights, "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "curve": curve, "seconds": seconds}, tmp)
        tmp.replace(state_path)

    began = time.perf_counter() - seconds
    bar = tqdm(range(start, config.steps), desc="samcache adapt", initial=start, total=config.steps, disable=not progress)
    for step in bar:
        batch = [data.conversation(step * config.batch_size + k) for k in range(config.batch_size)]
        loss = weighted_loss(net, encode_batch(processor, batch, config.answer_weight), attention)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
        seconds = time.perf_counter() - began
        if held and (done % config.eval_every == 0 or done == config.steps):
            point = {"step": done, "loss": loss.item(), "seconds": seconds}
            for n, convs in held.items():
                scores = teacher_forced(net, processor, convs, attention)
                point[f"answers_{n}_image"] = scores["answers"]
                point[f"description_{n}_image"] = scores["description_tokens"]
            curve.append(point)
            bar.write(json.dumps(point))
        if done % config.save_every == 0 and done < config.steps:
            save_state(done)
    if config.lora_rank:
        net = net.merge_and_unload()
    net.to(torch.device("cpu")).to(saved_dtype).save_pretrained(out)
    record = {"base": str(model), "config": asdict(config), "image_attention": attention.to_dict(), "curve": curve,
              "seconds": seconds}
    (out / RECORD).write_text(json.dumps(record, indent=2))
    write_profile(make_profile(out, None), out)
    state_path.unlink(missing_ok=True)
    return record


def add_arguments(parser) -> None:
    """``samcache adapt``'s flags (the CLI's sub-command)."""
    d = AdaptConfig()
    parser.add_argument("model", help="the checkpoint to adapt (a Qwen2.5-VL-style folder)")
    parser.add_argument("--out", required=True, help="the adapted checkpoint's folder")
    parser.add_argument("--data", default=d.data, help="'synthetic' (the visual-QA tasks) or a .jsonl of conversations")
    parser.add_argument("--image-attention", default=d.image_attention, help="isolated (default) or isolated-nosink")
    parser.add_argument("--link-tokens", type=int, default=d.link_tokens, metavar="N",
                        help="link tokens after each image (text in context, always computed; default none)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--lora-rank", type=int, default=d.lora_rank, help="0: full fine-tune; R: LoRA adapters (peft)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA scaling (default 2 x rank)")
    parser.add_argument("--answer-weight", type=float, default=d.answer_weight)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--eval-examples", type=int, default=d.eval_examples)
    parser.add_argument("--save-every", type=int, default=d.save_every)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=d.threads)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_of(args) -> AdaptConfig:
    return AdaptConfig(image_attention=args.image_attention, link_tokens=args.link_tokens, data=args.data,
                       steps=args.steps, batch_size=args.batch_size,
                       lr=args.lr, warmup=args.warmup, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                       answer_weight=args.answer_weight, eval_every=args.eval_every, eval_examples=args.eval_examples,
                       save_every=args.save_every, seed=args.seed, threads=args.threads, device=args.device)


__all__ = ["AdaptConfig", "JsonlData", "LORA_TARGETS", "RECORD", "STATE", "SyntheticData", "adapt", "add_arguments",
           "config_of"]
