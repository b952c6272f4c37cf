"""The visual-QA training script runs end to end (a few steps): checkpoint, processor and the
accuracy curve are written, and the checkpoint loads as a Hugging Face model."""

from __future__ import annotations

import json

import pytest

from samcache.tasks.training import TrainConfig, train


def test_a_few_steps_write_a_loadable_checkpoint(tmp_path):
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[0]))
    report = train(tmp_path, TrainConfig(steps=3, batch_size=2, eval_every=3, eval_examples=2, warmup=1,
                                         curriculum=((1, 0.5), (2, 0.5)), model_sizes=sizes), progress=False)
    curve = report["curve"]
    assert len(curve) == 1 and curve[0]["step"] == 3 and curve[0]["examples_seen"] == 6
    assert 0.0 <= curve[0]["accuracy_1_image"] <= 1.0 and 0.0 <= curve[0]["accuracy_4_image"] <= 1.0
    assert json.loads((tmp_path / "training.json").read_text())["curve"] == curve
    from samcache.models import model_class

    model_class("qwen2_5_vl").from_pretrained(tmp_path)


def test_curriculum_stages():
    config = TrainConfig(steps=10, curriculum=((1, 0.5), (4, 0.5)))
    assert [config.images_at(s) for s in range(10)] == [1] * 5 + [4] * 5


@pytest.mark.parametrize("bad", [dict(steps=0), dict(batch_size=0)])
def test_bad_config_is_refused(tmp_path, bad):
    with pytest.raises(ValueError):
        train(tmp_path, TrainConfig(**bad), progress=False)
