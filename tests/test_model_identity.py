"""One model fingerprint (samcache.model_identity) for the engine and both plugins: a local
checkpoint is named by its content, another runtime's name by that name, and every detail that
changes the KV changes the id."""

import shutil
from types import SimpleNamespace

import pytest

from samcache.integrations.sglang.identity import server_model_id
from samcache.integrations.vllm.identity import model_id as vllm_model_id
from samcache.model_identity import model_fingerprint, weights_digest


def checkpoint(folder, weights: bytes = b"\x01" * 300_000):
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_a_local_checkpoint_is_named_by_its_content(tmp_path):
    a = checkpoint(tmp_path / "a")
    moved = tmp_path / "elsewhere"
    shutil.copytree(a, moved)
    assert weights_digest(a) == weights_digest(moved)  # the path does not count ...
    assert model_fingerprint(a) == f"a:{weights_digest(a)}"  # ... but the engine's id shows the folder's name
    other = checkpoint(tmp_path / "b", b"\x01" * 150_000 + b"\x02" + b"\x01" * 149_999)  # one byte in a sampled chunk
    assert weights_digest(other) != weights_digest(a)
    assert weights_digest(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        model_fingerprint(tmp_path / "missing")
    with pytest.raises(ValueError, match="checkpoint must be a non-empty path or name"):
        model_fingerprint("", runtime="vllm")


def test_a_runtime_id_names_the_checkpoint_and_every_detail(tmp_path):
    a = checkpoint(tmp_path / "a")
    base = model_fingerprint(a, runtime="vllm", revision=None, dtype="bfloat16")
    assert base == f"vllm|{weights_digest(a)}|revision=None|dtype=bfloat16"
    assert model_fingerprint(a, runtime="sglang", revision=None, dtype="bfloat16") != base
    assert model_fingerprint(a, runtime="vllm", revision=None, dtype="float16") != base
    assert model_fingerprint("Qwen/Qwen2.5-VL-7B-Instruct", runtime="vllm", revision="main") == \
        "vllm|Qwen/Qwen2.5-VL-7B-Instruct|revision=main"  # a hub name: by its name


def test_the_plugins_take_their_ids_from_the_one_function(tmp_path):
    a = checkpoint(tmp_path / "a")
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(a), revision=None, dtype="bfloat16",
                                     hf_config=SimpleNamespace(architectures=["Qwen2_5_VLForConditionalGeneration"])),
        cache_config=SimpleNamespace(cache_dtype="auto"))
    assert vllm_model_id(vllm_config) == model_fingerprint(
        a, runtime="vllm", revision=None, dtype="bfloat16", architectures="Qwen2_5_VLForConditionalGeneration",
        kv_dtype="auto")
    ctx = SimpleNamespace(model_config=SimpleNamespace(model_path=str(a), revision=None, dtype="bfloat16",
                                                       hf_config=SimpleNamespace(architectures=["X"])),
                          server_args=SimpleNamespace(kv_cache_dtype="fp8_e4m3"))
    assert server_model_id(ctx).startswith(f"sglang|{weights_digest(a)}|")
    assert server_model_id(ctx) != server_model_id(
        SimpleNamespace(model_config=ctx.model_config, server_args=SimpleNamespace(kv_cache_dtype="auto")))
