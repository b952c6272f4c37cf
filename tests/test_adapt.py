"""`samcache adapt`: fine-tuning a checkpoint to isolated image attention (samcache.tasks.adapt) on
the tiny random Qwen2.5-VL, a few steps: what it writes, that a resumed run equals one never
stopped, LoRA, and bad data or flags refused before anything is written."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from samcache.cli import main as cli  # noqa: E402
from samcache.profile.image_attention import declared  # noqa: E402
from samcache.profile.reuse_profile import read_profile  # noqa: E402
from samcache.tasks.adapt import RECORD, STATE, AdaptConfig, adapt  # noqa: E402
from samcache.tasks.image_isolation import link_tokens, vision_ids_enabled  # noqa: E402


@pytest.fixture()
def base(tiny_checkpoints, tmp_path):
    out = tmp_path / "base"
    shutil.copytree(tiny_checkpoints["qwen2_5_vl"], out)
    return out


def small(**kw):
    return AdaptConfig(**{"steps": 4, "batch_size": 2, "warmup": 1, "eval_examples": 2, "eval_every": 4,
                          "save_every": 2, **kw})


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_adapt_writes_an_isolated_checkpoint_with_its_profile(base, tmp_path):
    out = tmp_path / "out"
    record = adapt(base, out, small(link_tokens=2), progress=False)
    assert declared(out).isolated and vision_ids_enabled(out) and link_tokens(out) == 2
    assert read_profile(out, out).image_attention.isolated
    assert json.loads((out / RECORD).read_text())["curve"][-1]["step"] == 4 == record["curve"][-1]["step"]
    assert not (out / STATE).exists()
    before, after = weights(base), weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_resumed_run_equals_one_never_stopped(base, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    adapt(base, whole, small(), progress=False)
    stopped = tmp_path / "stopped"
    import samcache.tasks.adapt as module

    real = module.weighted_loss
    calls = {"n": 0}

    def stop_after_two(*a, **kw):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(module, "weighted_loss", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        adapt(base, stopped, small(), progress=False)
    assert (stopped / STATE).is_file()
    monkeypatch.setattr(module, "weighted_loss", real)
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        adapt(base, stopped, small(lr=1e-3), resume=True, progress=False)
    adapt(base, stopped, small(), resume=True, progress=False)
    a, b = weights(whole), weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_adapts_the_language_model_and_merges(base, tmp_path):
    out = tmp_path / "lora"
    adapt(base, out, small(lora_rank=4, steps=2, eval_every=2), progress=False)
    before, after = weights(base), weights(out)
    assert set(before) == set(after)  # merged: no adapter tensors left
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(k.startswith("model.layers.") and k.endswith("_proj.weight") for k in changed)


def test_jsonl_data(base, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    Image.fromarray(np.full((56, 84, 3), 200, dtype=np.uint8)).save(folder / "a.png")
    line = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                      {"type": "text", "text": "What colour?"}]},
                         {"role": "assistant", "content": "Grey."}]}
    data = folder / "train.jsonl"
    data.write_text(json.dumps(line) + "\n")
    adapt(base, tmp_path / "out", small(data=str(data), steps=2, eval_examples=0), progress=False)
    assert declared(tmp_path / "out").isolated


@pytest.mark.parametrize("content, match", [
    ("{not json", r"train\.jsonl:1: not JSON"),
    ('{"messages": []}', "at least one message"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]}, '
     '{"role": "assistant", "content": "x"}]}', r"train\.jsonl:1: image 'gone\.png' not found"),
    ('{"messages": [{"role": "user", "content": [{"type": "image", "image": "bad.png"}]}, '
     '{"role": "assistant", "content": "x"}]}', r"image 'bad\.png' cannot be read"),
])
def test_bad_data_is_refused_before_anything_is_written(base, tmp_path, content, match):
    data = tmp_path / "train.jsonl"
    data.write_text(content + "\n")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=match):
        adapt(base, tmp_path / "out", small(data=str(data)), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, match", [
    (["--steps", "0"], "--steps must be an int >= 1"),
    (["--lr", "-1"], "--lr must be a number > 0"),
    (["--lora-rank", "-2"], "--lora-rank must be an int >= 0"),
    (["--image-attention", "causal"], "adapt trains isolated image attention"),
    (["--image-attention", "sideways"], "unknown image attention"),
    (["--data", "notes.txt"], "--data must be 'synthetic' or a .jsonl file"),
    (["--resume"], "holds no saved state"),
])
def test_bad_flags_are_refused(base, tmp_path, capsys, flags, match):
    assert cli(["adapt", str(base), "--out", str(tmp_path / "out"), "--quiet", *flags]) == 2
    assert match in capsys.readouterr().err
