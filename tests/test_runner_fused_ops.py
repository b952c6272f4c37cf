"""The layer loop's fused kernels: which models take them, that a reuse turn's forward runs them
(and reads nothing back into Python), and that they leave the engine's outputs exact."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from samcache.bench.op_count import OpCounter, forward_phase  # noqa: E402
from samcache.engine import screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402

from engine_helpers import SIZE, make_engine  # noqa: E402


def counted_reuse_turn(engine):
    """Serve 3 images, then a turn showing them in another order behind another system prompt,
    counting the ops the forward step of that turn dispatches."""
    images = [screenshot(40 + i, SIZE) for i in range(3)]

    def turn(system, shown):
        return engine.chat(messages=[{"role": "system", "content": system}, user_message(shown, "Which one?")],
                           max_new_tokens=1)

    counter = OpCounter("outside")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        turn("You operate a computer.", images)
        with forward_phase(engine, counter, after="outside"), counter:
            result = turn("Step 2: the latest screenshots.", images[::-1])
    return result, counter


def test_qwen2_5_vl_reuse_turn_runs_the_fused_kernels_and_reads_nothing_back(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen2_5_vl"], recompute_ratio=0.2)
    runner = engine.runner
    assert runner.fused_norms and runner.fused_rope
    result, counter = counted_reuse_turn(engine)
    assert result.metrics.image_reused_tokens > 0 and result.metrics.recomputed_tokens > 0
    ops = counter.counts["forward"]
    layers = runner.num_layers
    assert ops["samcache::rope_qkv_write"] == layers and ops["samcache::add_rms_norm"] == layers
    assert ops["samcache::rms_norm"] == layers + 1  # each layer's input norm and the final one
    for replaced in ("aten::pow", "aten::rsqrt", "aten::mean", "samcache::paged_write"):
        assert ops[replaced] == 0, f"{replaced} still dispatched {ops[replaced]} times"
    assert counter.syncing("forward") == {}, "the forward read a tensor back into Python"


def test_qk_norm_models_keep_the_unfused_rope(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen3_vl_moe"])
    assert engine.runner.fused_norms and not engine.runner.fused_rope
    _, counter = counted_reuse_turn(engine)
    ops = counter.counts["forward"]
    assert ops["samcache::rope_qkv_write"] == 0 and ops["samcache::paged_write"] == engine.runner.num_layers


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_fused_forward_matches_the_modules_forward(tiny_checkpoints, family):
    """The same full prefill with the fused kernels and with the model's own modules: within a few
    float32 ulps (only the norm's sum of squares is added in another order)."""
    fused = make_engine(tiny_checkpoints[family])
    plain = make_engine(tiny_checkpoints[family], share_weights_with=fused)
    plain.runner.fused_norms = plain.runner.fused_rope = False
    msgs = [{"role": "system", "content": "Be brief."}, user_message([screenshot(7, SIZE)], "What is shown?")]
    got, counters = [], []
    for engine in (fused, plain):
        prompt = engine.build_prompt(msgs)
        with OpCounter() as counter:
            pre, logits = engine.prefill(prompt)
        engine.pool.free_sequence(pre.seq)
        got.append(logits)
        counters.append(counter.counts["all"])
    layers = fused.runner.num_layers
    assert counters[0]["samcache::add_rms_norm"] == layers  # the kernels ran ...
    assert counters[1]["samcache::add_rms_norm"] == counters[1]["samcache::rms_norm"] == 0  # ... and the modules
    torch.testing.assert_close(got[0], got[1], atol=2e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_reuse_turn_forward_synchronises_nothing(tiny_checkpoints):
    """Between the first layer and the logits nothing waits for the GPU (torch's sync debug mode
    flags every synchronising call: reads back, pageable copies, data-dependent sizes)."""
    engine = make_engine(tiny_checkpoints["qwen2_5_vl"], device="cuda", recompute_ratio=0.2)
    images = [screenshot(60 + i, SIZE) for i in range(3)]
    engine.chat(messages=[{"role": "system", "content": "A."}, user_message(images, "Which one?")], max_new_tokens=1)
    flagged, forward = [], engine.executor.forward

    def watched(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return forward(steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                flagged.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))

    engine.executor.forward = watched
    result = engine.chat(messages=[{"role": "system", "content": "B."}, user_message(images[::-1], "Which one?")],
                         max_new_tokens=1)
    assert result.metrics.image_reused_tokens > 0
    assert not flagged, f"{len(flagged)} synchronising calls in the forward, the first: {flagged[0]}"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe", "internvl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_are_the_rotary_modules_bits(tiny_checkpoints, family, dtype):
    runner = make_engine(tiny_checkpoints[family]).runner
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 40_000, (3, 300), generator=g)
    like = torch.zeros(1, dtype=dtype)
    rotary = runner.text.rotary_emb
    if runner.family.mrope:
        want_cos, want_sin = rotary(like, positions[:, None, :])
    else:
        want_cos, want_sin = rotary(like, positions[:1])
    cos, sin = runner.rope(positions, like)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def test_frequency_axes_rows_and_bad_input():
    from samcache.engine.layer_parts import frequency_axes

    assert frequency_axes("mrope", [2, 1, 1], 4).tolist() == [0, 0, 1, 2]
    assert frequency_axes("mrope_interleaved", [2, 1, 1], 4).tolist() == [0, 1, 2, 0]
    assert frequency_axes("neox", [], 3).tolist() == [0, 0, 0]
    for args, match in ((("yarn", [], 4), "unknown RoPE style"), (("mrope", [2, 1], 4), "summing to 4"),
                        (("mrope", [2, 2, 2], 4), "summing to 4"), (("mrope", [5, -1, 0], 4), "counts >= 0"),
                        (("neox", [], 0), "half"), (("neox", [], True), "half")):
        with pytest.raises(ValueError, match=match):
            frequency_axes(*args)


def test_forward_phase_refuses_what_is_not_a_counter():
    from samcache.bench.op_count import forward_phase

    with pytest.raises(TypeError, match="OpCounter"):
        with forward_phase(object(), {}, after="x"):
            pass
    with pytest.raises(TypeError, match="phase name"):
        with forward_phase(object(), OpCounter(), after=3):
            pass
