"""Shipping a trained visual-QA checkpoint: ship() writes float16 weights with checksums that
load as a Hugging Face model; verify() and ship() refuse damaged or incomplete checkpoints."""

from __future__ import annotations

import json

import pytest

from samcache.tasks import checkpoint


@pytest.fixture
def trained_run(tmp_path):
    from samcache.random_checkpoints import build_tiny_model

    run = build_tiny_model("qwen2_5_vl", tmp_path / "run", seed=0)
    (run / "training.json").write_text(json.dumps({"config": {"size": [84, 84]}, "curve": []}))
    return run


def test_ship_writes_float16_weights_with_checksums(trained_run, tmp_path):
    from safetensors.torch import load_file

    from samcache.random_checkpoints import model_class

    dest = checkpoint.ship(trained_run, tmp_path / "shipped")
    weights = load_file(dest / "model.safetensors")
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {__import__("torch").float16}
    assert checkpoint.verify(dest) == dest
    model_class("qwen2_5_vl").from_pretrained(dest)  # loads as a Hugging Face checkpoint


def test_the_shipped_record_holds_every_stage_it_was_fine_tuned_through(trained_run, tmp_path):
    """A run continued from other runs ships their records too (oldest first); the chain stops at
    a shipped checkpoint, which carries its own."""
    first = tmp_path / "first"
    first.mkdir()
    shipped_parent = str(checkpoint.SHIPPED)
    (first / "training.json").write_text(json.dumps({"config": {"steps": 1200, "init_from": shipped_parent},
                                                     "curve": [{"step": 1200}]}))
    (trained_run / "training.json").write_text(json.dumps({"config": {"size": [84, 84], "init_from": str(first)},
                                                           "curve": [{"step": 600}]}))
    record = json.loads((checkpoint.ship(trained_run, tmp_path / "shipped") / "training.json").read_text())
    assert record["curve"] == [{"step": 600}] and record["config"]["size"] == [84, 84]
    assert [s["config"]["steps"] for s in record["previous_stages"]] == [1200]
    assert checkpoint.training_record(first) == json.loads((first / "training.json").read_text())  # no earlier run


def test_damaged_or_incomplete_checkpoints_are_refused(trained_run, tmp_path):
    dest = checkpoint.ship(trained_run, tmp_path / "shipped")
    weights = dest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its checksum"):
        checkpoint.verify(dest)
    weights.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="missing"):
        checkpoint.verify(dest)
    (dest / checkpoint.CHECKSUMS).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="SHA256SUMS is missing"):
        checkpoint.verify(dest)
    (trained_run / "training.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not a finished training run"):
        checkpoint.ship(trained_run, tmp_path / "again")


def test_the_shipped_checkpoint_matches_its_checksums_and_reads_images():
    """The checkpoint in the package: intact, and better than chance on held-out questions. It
    scored 97.0% on one image over 200 fresh examples (docs/benchmark.md); 16 examples at 62.5% or
    more rule out chance (1/8 to 1/12) and a broken load, in seconds."""
    from samcache.tasks.heldout import score_checkpoint

    folder = checkpoint.trained_model()  # verified against its checksums
    result = score_checkpoint(folder, examples=16, images=[1], progress=False)
    one = result["1_image"]
    assert one["examples"] == 16 and one["correct"] == round(one["accuracy"] * 16), result
    assert one["accuracy"] >= 0.625, result
    lo, hi = one["interval"]
    assert lo <= one["accuracy"] <= hi
    # where the errors come from: per question type, and description against lookup
    tallies = one["by_question"].values()
    assert sum(t["examples"] for t in tallies) == 16 and sum(t["correct"] for t in tallies) == one["correct"]
    assert set(one["by_question"]) <= {"colour", "where", "label"}  # the single-image gui questions
    assert 0.0 <= one["described_parts"] <= 1.0
    assert 0 <= one["wrong_after_exact_description"] <= 16 - one["correct"]


def test_heldout_scoring_refuses_what_it_cannot_score(trained_run, tmp_path, capsys):
    from samcache.tasks.heldout import main, score_checkpoint

    for bad in (dict(examples=0), dict(images=[]), dict(images=[0]), dict(start=-1)):
        with pytest.raises(ValueError):
            score_checkpoint(trained_run, progress=False, **bad)
    (trained_run / "training.json").unlink()
    with pytest.raises(ValueError, match="no training.json"):
        score_checkpoint(trained_run, progress=False)
    assert main([str(trained_run)]) == 2 and "no training.json" in capsys.readouterr().err


def test_evaluate_returns_the_replies_it_scored_and_refuses_a_bad_flag():
    import torch

    from samcache.engine.loading import load_processor
    from samcache.random_checkpoints import model_class
    from samcache.tasks import visual_qa
    from samcache.tasks.training import evaluate

    folder = checkpoint.trained_model()
    model = model_class("qwen2_5_vl").from_pretrained(folder, dtype=torch.float32)
    processor = load_processor(folder)
    exs = list(visual_qa.examples("test", 3, size=(84, 84)))
    with pytest.raises(TypeError, match="replies must be a bool"):
        evaluate(model, processor, exs, visual_qa.messages, dense=True, replies="yes")
    got = evaluate(model, processor, exs, visual_qa.messages, dense=True, replies=True)
    assert len(got["replies"]) == 3 and all(isinstance(r, str) for r in got["replies"])
    assert got["accuracy"] == sum(visual_qa.is_correct(r, ex.answer) for r, ex in zip(got["replies"], exs)) / 3
    assert "replies" not in evaluate(model, processor, exs[:1], visual_qa.messages, dense=True)


def test_calibration_finds_that_the_trained_model_needs_its_images_in_order():
    """keep_image_order="auto" on the model that writes an image's index into its KV: on a pair of
    turns where a screenshot moves from second to first, reuse at recompute 0 changes confident
    tokens of the reply (run 24: 120 of 127 kept), recomputing everything changes none, so the
    engine keeps images at their own index at 0.05 and not at 1.0; then serves the trace so."""
    from samcache.engine import SAMcacheEngine
    from samcache.bench.task_accuracy import calibration_pairs, reordered_turns, training_defaults
    from samcache.recompute.image_order import MIN_CONFIDENT_TOKENS
    from samcache.tasks import visual_qa

    folder = checkpoint.trained_model()
    size = training_defaults(folder)["size"]
    trace = visual_qa.trace(visual_qa.split_seed("test", 2_000_000, 0), scenario="gui", turns=3, window=2, size=size,
                            dense=True)
    assert reordered_turns(trace) == [False, False, True]  # the third turn shows the second screenshot first
    engine = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=64 << 20)
    assert engine.keep_image_order == "auto" and engine.keeps_image_order()  # no calibration yet: the order is kept
    curves = engine.calibrate(requests=calibration_pairs([trace]), rates=(0.0, 0.05, 1.0),
                              continuation=max(t.max_new_tokens for t in trace), progress=False)
    order = curves.image_order
    assert order.pairs == 1 and order.confident >= MIN_CONFIDENT_TOKENS  # the pair (turn 2, turn 3)
    assert order.agreement(0.0) < 0.99 and order.agreement(1.0) == 1.0
    assert engine.keeps_image_order() and engine.keeps_image_order(0.0) and not engine.keeps_image_order(1.0)
    for keep, hits in (("auto", 0), (False, 1)):
        served = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=64 << 20, sensitivity=curves,
                                keep_image_order=keep, share_weights_with=engine)
        last = [served.chat(messages=t.messages, max_new_tokens=4) for t in trace][-1]
        assert last.metrics.image_kv_hits == hits, keep  # the moved screenshot: prefilled again, or reused


def test_the_shipped_isolated_checkpoint_declares_itself_and_carries_its_profile():
    """The fine-tuned checkpoint with isolated image attention: intact, declaring its attention,
    vision ids in its template, its reuse profile valid for it, and reading single screenshots
    (16 held-out examples, through samcache's engine: its own attention)."""
    from samcache.profile.image_attention import declared
    from samcache.profile.reuse_profile import find_profile
    from samcache.tasks.heldout import score_checkpoint
    from samcache.tasks.image_isolation import vision_ids_enabled

    folder = checkpoint.isolated_model()  # verified against its checksums, the profile included
    assert declared(folder).isolated and vision_ids_enabled(folder)
    profile = find_profile(folder)
    assert profile is not None and profile.image_attention == declared(folder)
    result = score_checkpoint(folder, examples=16, images=[1], progress=False)
    assert result["image_attention"] == declared(folder).name and result["1_image"]["accuracy"] >= 0.625, result


def test_the_isolated_model_reuses_moved_screenshots_with_the_full_prefills_replies():
    """On a held-out gui trace (window 3: from the third turn on, every known screenshot sits at
    another index), samcache's defaults reuse every known screenshot and reply as a full prefill
    does, turn for turn."""
    from samcache.bench.task_accuracy import reordered_turns, training_defaults
    from samcache.engine import SAMcacheEngine
    from samcache.tasks import visual_qa

    folder = checkpoint.isolated_model()
    trace = visual_qa.trace(visual_qa.split_seed("test", 2_000_001, 0), scenario="gui", turns=4, window=3,
                            size=training_defaults(folder)["size"], dense=True)
    assert reordered_turns(trace)[3]
    full = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=64 << 20, cache_enabled=False)
    fast = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=64 << 20, share_weights_with=full)
    assert not fast.keeps_image_order()
    for k, turn in enumerate(trace):
        mine = fast.chat(messages=turn.messages, max_new_tokens=turn.max_new_tokens)
        ref = full.chat(messages=turn.messages, max_new_tokens=turn.max_new_tokens)
        assert mine.token_ids == ref.token_ids, k
        if k:
            assert mine.metrics.image_reused_tokens > 0 and mine.metrics.recomputed_tokens == 0
    fast.check_invariants()


def test_the_engine_serves_the_isolated_model_as_its_masked_reference_decodes():
    """Greedy replies of samcache's engine (every image computed alone, spliced) equal those of the
    Hugging Face forward with explicit per-layer masks, on held-out multi-image questions."""
    import torch

    from samcache.engine import ChatRequest, SAMcacheEngine
    from samcache.engine.loading import load_processor
    from samcache.profile.image_attention import declared
    from samcache.random_checkpoints import model_class
    from samcache.tasks import visual_qa
    from samcache.tasks.image_isolation import greedy_reply

    folder = checkpoint.isolated_model()
    model = model_class("qwen2_5_vl").from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(folder)
    engine = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=64 << 20, cache_enabled=False)
    exs = [visual_qa.make_example(visual_qa.split_seed("test", 20_000 + i, 0), num_images=3, size=(84, 84))
           for i in range(2)]
    msgs = [visual_qa.messages(ex, dense=True, answer=False) for ex in exs]
    served = engine.chat_batch([ChatRequest(messages=m, max_new_tokens=60) for m in msgs])
    for m, got in zip(msgs, served):
        assert got.text == greedy_reply(model, processor, m, declared(folder), 60)
