"""The visual-QA training script runs end to end (a few steps): checkpoint, processor and the
accuracy curve are written, and the checkpoint loads as a Hugging Face model."""

from __future__ import annotations

import json

import pytest

from samcache.tasks import visual_qa as vqa
from samcache.tasks.training import (
    PROBED_ATTRIBUTES,
    TrainConfig,
    _probe_targets,
    _token_cells,
    encode_batch,
    train,
    weighted_loss,
)

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[0]))


def test_a_few_steps_write_a_loadable_checkpoint(tmp_path):
    sizes = SIZES
    report = train(tmp_path, TrainConfig(steps=3, batch_size=2, eval_every=3, eval_examples=2, warmup=1,
                                         vision_steps=3, vision_batch_size=2, size=(84, 84),
                                         curriculum=((1, 0.5), (2, 0.5)), model_sizes=sizes), progress=False)
    vision = report["vision_curve"]
    assert [p["step"] for p in vision] == [3]
    assert all(0.0 <= vision[0][f"{a}_accuracy"] <= 1.0 for a in PROBED_ATTRIBUTES)
    curve = report["curve"]
    assert len(curve) == 1 and curve[0]["step"] == 3 and curve[0]["examples_seen"] == 6
    assert 0.0 <= curve[0]["accuracy_1_image"] <= 1.0 and 0.0 <= curve[0]["accuracy_4_image"] <= 1.0
    assert json.loads((tmp_path / "training.json").read_text())["curve"] == curve
    from samcache.random_checkpoints import model_class

    model_class("qwen2_5_vl").from_pretrained(tmp_path)


@pytest.mark.cuda
def test_a_few_steps_on_cuda_write_the_same_kind_of_checkpoint(tmp_path):
    import torch

    report = train(tmp_path, TrainConfig(steps=2, batch_size=2, eval_every=2, eval_examples=2, warmup=1,
                                         vision_steps=2, vision_batch_size=2, size=(84, 84), curriculum=((2, 1.0),),
                                         model_sizes=SIZES, device="cuda"), progress=False)
    assert report["config"]["device"] == "cuda" and report["curve"][0]["step"] == 2
    from samcache.random_checkpoints import model_class

    model = model_class("qwen2_5_vl").from_pretrained(tmp_path)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())


def test_curriculum_stages():
    config = TrainConfig(steps=10, curriculum=((1, 0.5), (4, 0.5)))
    assert [config.images_at(s) for s in range(10)] == [1] * 5 + [4] * 5


@pytest.mark.parametrize("bad", [dict(steps=0), dict(stop_after=0), dict(steps=2, stop_after=3), dict(batch_size=0), dict(vision_steps=-1), dict(answer_weight=0.0),
                                 *([dict(device="cuda")] if not __import__("torch").cuda.is_available() else [])])
def test_bad_config_is_refused(tmp_path, bad):
    with pytest.raises(ValueError):
        train(tmp_path, TrainConfig(**bad), progress=False)


def test_image_tokens_map_to_the_cells_under_them():
    assert _token_cells((84, 84), (3, 3)) == list(vqa.CELLS)
    big = _token_cells((168, 168), (6, 6))
    assert big[0] == big[1] == big[6] == big[7] == "top left" and big[-1] == "bottom right"
    spec = vqa.make_example(5, size=(84, 84)).specs[0]
    targets = _probe_targets(spec, list(vqa.CELLS))
    assert targets["cell"] == list(range(1, 10))
    assert _probe_targets(spec, [None])["cell"] == [0]
    for cell, colour, kind, label in zip(vqa.CELLS, targets["colour"], targets["kind"], targets["label"]):
        e = spec.element_at(cell)
        if e is None:
            assert colour == kind == label == 0
        else:
            assert (list(vqa.COLOURS)[colour - 1], vqa.KINDS[kind - 1], vqa.LABELS[label - 1]) == (e.colour, e.kind, e.label)


def test_labels_cover_every_assistant_reply_and_nothing_else(tmp_path):
    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import build_tiny_model

    build_tiny_model("qwen2_5_vl", tmp_path, seed=0, **SIZES)
    processor = load_processor(tmp_path)
    seed = next(s for s in range(100) if len(vqa.framed_messages(vqa.make_example(s, num_images=2, size=(84, 84)), s)) > 3)
    ex = vqa.make_example(seed, num_images=2, size=(84, 84))
    two_turns = vqa.framed_messages(ex, seed)
    one_turn = vqa.messages(vqa.make_example(1, size=(84, 84)))
    enc = encode_batch(processor, [two_turns, one_turn])
    tok = processor.tokenizer
    replies = [m["content"] for m in two_turns if m["role"] == "assistant"]
    for row, expected in zip(enc["labels"], [replies, [one_turn[-1]["content"]]]):
        kept = row[row != -100]
        assert tok.decode(kept) == "".join(f"{r}<|im_end|>" for r in expected)
    assert (enc["labels"][1][enc["attention_mask"][1] == 0] == -100).all()  # padding is never a target


def test_vision_stage_refuses_documents(tmp_path):
    with pytest.raises(ValueError, match="vision stage"):
        train(tmp_path, TrainConfig(steps=1, kind="docs", model_sizes=SIZES), progress=False)


def test_answer_tokens_weigh_more_and_weight_one_is_the_plain_loss(tmp_path):
    import torch

    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import build_tiny_model, model_class

    build_tiny_model("qwen2_5_vl", tmp_path, seed=0, **SIZES)
    processor = load_processor(tmp_path)
    ex = vqa.make_example(3, num_images=2, size=(84, 84))
    batch = [vqa.messages(ex, dense=True), vqa.messages(vqa.make_example(4, size=(84, 84)))]
    enc = encode_batch(processor, batch, answer_weight=20.0)
    tok = processor.tokenizer
    heavy = enc["input_ids"][0][enc["loss_weights"][0] == 20.0]
    assert tok.decode(heavy) == f"Answer: {ex.answer}<|im_end|>"
    # With an evidence line, the lookup it holds weighs as much as the answer.
    evidence = encode_batch(processor, [vqa.messages(ex, dense=True, evidence=True)], answer_weight=20.0)
    heavy = evidence["input_ids"][0][evidence["loss_weights"][0] == 20.0]
    assert tok.decode(heavy) == f"Found: {vqa.evidence_line(ex)}\nAnswer: {ex.answer}<|im_end|>"
    assert ((enc["loss_weights"] > 0) == (enc["labels"] != -100)).all()
    model = model_class("qwen2_5_vl").from_pretrained(tmp_path)
    plain = encode_batch(processor, batch)
    with torch.no_grad():
        inputs = {k: v for k, v in plain.items() if k != "loss_weights"}
        assert torch.allclose(weighted_loss(model, plain), model(**inputs).loss, rtol=1e-5)
        assert not torch.allclose(weighted_loss(model, enc), weighted_loss(model, plain))


def test_a_run_stops_part_way_through_its_schedule(tmp_path):
    small = dict(batch_size=2, eval_every=5, eval_examples=1, warmup=1, size=(84, 84), vision_steps=0,
                 curriculum=((1, 1.0),), model_sizes=SIZES)
    report = train(tmp_path, TrainConfig(steps=6, stop_after=2, **small), progress=False)
    # The last step run is evaluated and written, and no step after it ran.
    assert [p["step"] for p in report["curve"]] == [2] and report["curve"][0]["examples_seen"] == 4
    assert (tmp_path / "model.safetensors").exists()


def test_a_run_continues_from_an_earlier_one(tmp_path):
    from safetensors.torch import load_file

    small = dict(batch_size=2, eval_every=2, eval_examples=1, warmup=1, size=(84, 84), vision_steps=0,
                 curriculum=((1, 1.0),), model_sizes=SIZES)
    first = train(tmp_path / "a", TrainConfig(steps=2, **small), progress=False)
    assert first["config"]["first_example"] == 0 and first["curve"][-1]["examples_seen"] == 4
    before = load_file(tmp_path / "a" / "model.safetensors")
    # The sizes given for a new model do not apply: training.json records the model continued.
    second = train(tmp_path / "b", TrainConfig(steps=2, init_from=str(tmp_path / "a"), **{**small, "model_sizes": {}}),
                   progress=False)
    assert second["config"]["first_example"] == 4  # new examples, not the first run's again
    recorded = second["config"]["model_sizes"]
    assert recorded["hidden_size"] == SIZES["hidden_size"] and recorded["num_hidden_layers"] == 1
    assert recorded["vision_config"]["depth"] == 1 and recorded["vision_config"]["hidden_size"] == 32
    after = load_file(tmp_path / "b" / "model.safetensors")
    assert set(after) == set(before) and any(not (after[k] == before[k]).all() for k in before)
    with pytest.raises(ValueError, match="not a training run"):
        train(tmp_path / "c", TrainConfig(steps=1, init_from=str(tmp_path / "nothing"), **small), progress=False)


def test_the_dense_token_budget_holds_the_longest_replies(tmp_path):
    """A budget too short cuts the answer off and scores a right reply as wrong."""
    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import build_tiny_model

    build_tiny_model("qwen2_5_vl", tmp_path, seed=0, **SIZES)
    tok = load_processor(tmp_path).tokenizer
    for n in range(1, vqa.MAX_IMAGES + 1):
        for kind in vqa.IMAGE_KINDS:
            longest = max(len(tok(vqa.dense_reply(vqa.make_example(vqa.split_seed("test", i), num_images=n, kind=kind,
                                                                   size=(84, 84)), evidence=True)
                                  + "<|im_end|>", add_special_tokens=False)["input_ids"]) for i in range(120))
            assert longest <= vqa.dense_token_budget(n), (n, kind, longest)


def test_deepening_a_checkpoint_keeps_its_outputs(tmp_path):
    import shutil

    import numpy as np
    import torch
    from PIL import Image

    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import build_tiny_model, model_class
    from samcache.tasks.training import _chat, deepen_checkpoint

    src = build_tiny_model("qwen2_5_vl", tmp_path / "a", seed=3, **SIZES)
    shutil.copytree(src, tmp_path / "b")
    deepen_checkpoint(tmp_path / "b", 2)
    ex = next(iter(vqa.examples("test", 1, num_images=2, size=(84, 84))))
    processor = load_processor(src)
    chat, images = _chat(vqa.messages(ex, answer=False))
    enc = processor(text=[processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)],
                    images=[Image.fromarray(np.asarray(i)) for i in images], return_tensors="pt")
    logits = []
    for path in (tmp_path / "a", tmp_path / "b"):
        model = model_class("qwen2_5_vl").from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(**enc).logits)
    deep = model_class("qwen2_5_vl").from_pretrained(tmp_path / "b")
    assert deep.config.text_config.num_hidden_layers == SIZES["num_hidden_layers"] + 2
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="extra"):
        deepen_checkpoint(tmp_path / "b", 0)


def test_an_isolated_run_declares_its_attention_and_scores_teacher_forced(tmp_path):
    """--image-attention isolated --vision-ids --link-tokens: the checkpoint declares how its images
    attend, its template writes "Picture k: " and the link tokens, and its held-out curve is
    teacher-forced (greedy decoding through generate() is causal only)."""
    from samcache.profile.image_attention import declared
    from samcache.tasks.image_isolation import link_tokens, vision_ids_enabled

    small = dict(batch_size=2, eval_every=2, eval_examples=2, warmup=1, size=(84, 84), vision_steps=0,
                 curriculum=((2, 1.0),), model_sizes=SIZES, evidence=True)
    report = train(tmp_path, TrainConfig(steps=2, image_attention="isolated", vision_ids=True, link_tokens=2, **small),
                   progress=False)
    assert declared(tmp_path).isolated and vision_ids_enabled(tmp_path) and link_tokens(tmp_path) == 2
    point = report["curve"][-1]
    assert "accuracy_4_image" not in point
    assert 0.0 <= point["forced_answers_4_image"] <= 1.0 and 0.0 < point["forced_description_1_image"] <= 1.0
    with pytest.raises(ValueError, match="at least one layer must be isolated"):
        train(tmp_path / "x", TrainConfig(steps=1, image_attention="isolated-top1", **small), progress=False)


def test_teacher_forced_scores_a_perfect_and_a_wrong_reply(tmp_path):
    """teacher_forced counts a reply's answer as right only when every token of it is predicted:
    checked against a model forced to predict the labels (a fake logits source)."""
    import torch

    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import build_tiny_model
    from samcache.tasks import training

    path = build_tiny_model("qwen2_5_vl", tmp_path / "m", **SIZES)
    processor = load_processor(path)
    ex = vqa.make_example(vqa.split_seed("test", 0), num_images=1, size=(84, 84))
    convs = [vqa.messages(ex, dense=True, evidence=True)]

    def oracle(shift):
        def forward(model, batch, attention):
            iso = {**batch, "labels": batch["labels"], "loss_weights": batch["loss_weights"]}
            ids = batch["labels"].clone()
            ids[ids < 0] = 0
            logits = torch.nn.functional.one_hot(torch.roll(ids, -1, dims=1), 1088).float()
            if shift:  # the very last answer token predicted wrong
                tail = (batch["loss_weights"] == 2.0).nonzero()
                b, t = tail[-1].tolist()
                logits[b, t - 1] = torch.roll(logits[b, t - 1], 1)
            return logits, iso
        return forward

    class Dummy(torch.nn.Module):
        training = False

    original = training.forward_logits
    try:
        training.forward_logits = oracle(False)
        assert training.teacher_forced(Dummy(), processor, convs)["answers"] == 1.0
        training.forward_logits = oracle(True)
        got = training.teacher_forced(Dummy(), processor, convs)
        assert got["answers"] == 0.0 and got["description_tokens"] == 1.0 and got["replies"] == 1
    finally:
        training.forward_logits = original
