"""samcache's vLLM plugin serving a model whose images attend in isolation, through the real vLLM
(CPU build) on a tiny checkpoint that declares it: first-seen images computed alone in side rows
of vLLM's own step, known ones spliced exactly at any index. The reference is samcache's engine on
the same checkpoint (itself tested against explicit 4-D masks in tests/test_image_isolation.py).

Runs in vLLM's environment, as tests/vllm_plugin/test_vllm_plugin.py."""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from samcache.integrations.vllm import read_metrics  # noqa: E402
from samcache.profile.image_attention import ImageAttention, declare  # noqa: E402

SIZE = (224, 336)  # 96 image tokens
IMAGES = {name: Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*SIZE, 3), dtype=np.uint8))
          for seed, name in enumerate("ABC")}
# (images, question, system prompt): first sight, a move after another system prompt, a new image
# beside a known one at another index, then the first prompt again (vLLM's prefix cache).
TURNS = [("AB", "open the menu", "Short."), ("BC", "click save", "A much longer system prompt here."),
         ("CA", "go back", "Short."), ("AB", "open the menu", "Short.")]


@pytest.fixture(scope="module")
def checkpoint(env):
    from samcache.random_checkpoints import build_tiny_model

    folder = build_tiny_model("qwen2_5_vl", env / "isolated")
    declare(folder, ImageAttention("isolated"))
    return str(folder)


def messages(names, text, system):
    return [{"role": "system", "content": system},
            {"role": "user", "content": [*({"type": "image", "image": np.asarray(IMAGES[n])} for n in names),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def engine_turns(checkpoint):
    """Each turn's prompt ids and first-token log-probs from samcache's engine (no cache: every
    image computed alone, as the model was trained)."""
    from samcache.engine import SAMcacheEngine

    engine = SAMcacheEngine(checkpoint, device="cpu", kv_cache_bytes=64 << 20, cache_enabled=False)
    out = []
    for names, text, system in TURNS:
        prompt = engine.build_prompt(messages(names, text, system))
        pre, logits = engine.prefill(prompt)
        engine.pool.free_sequence(pre.seq)
        out.append(([int(t) for t in prompt.token_ids], torch.log_softmax(logits.double(), -1).numpy()))
    return out


def make_llm(checkpoint, plugin: dict | None, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if plugin is not None:
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="SamcacheConnector", kv_role="kv_both",
                                                    kv_connector_extra_config=plugin)
    args = dict(model=checkpoint, dtype="float32", enforce_eager=True, block_size=32, max_model_len=2048,
                limit_mm_per_prompt={"image": 3}, enable_prefix_caching=True, seed=0, max_logprobs=-1,
                disable_chunked_mm_input=True)
    return LLM(**{**args, **kw})


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def first_logprobs(llm, ids: list[int], names: str):
    """vLLM's first-token log-probs for the engine's prompt ``ids`` (one image pad per image: vLLM's
    processor expands it)."""
    from vllm import SamplingParams

    text = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", llm.get_tokenizer().decode(ids))
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [IMAGES[n] for n in names]}}],
                       SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1), use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == ids  # the same prompt as the engine's
    return np.array([lp.logprob for _, lp in sorted(out.outputs[0].logprobs[0].items())]), out.num_cached_tokens


def test_the_plugin_serves_an_isolated_model_as_samcaches_engine(checkpoint, engine_turns, env):
    metrics = env / "isolated-metrics.json"
    llm = make_llm(checkpoint, {"metrics_path": str(metrics)})
    try:
        seen, cached = [], []
        for (ids, want), (names, _, _) in zip(engine_turns, TURNS):
            got, hit = first_logprobs(llm, ids, names)
            np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
            seen.append(read_metrics(metrics))
            cached.append(hit)
    finally:
        close(llm)
    first, moved, third, again = seen
    assert first.isolated_images == 2 and first.images_saved == 2 and first.image_kv_hits == 0
    assert moved.isolated_images == 3 and moved.image_kv_hits == 1 and moved.image_reused_tokens == 96
    assert third.isolated_images == 3 and third.image_kv_hits == 3 and third.image_reused_tokens == 288
    assert again.isolated_fallbacks == 0 and again.recomputed_tokens == 0 and cached[3] > 0  # the prefix cache kept it
    # The test can fail: vLLM alone computes the images in context, and answers otherwise.
    vanilla = make_llm(checkpoint, None)
    try:
        plain, _ = first_logprobs(vanilla, *[engine_turns[0][0], TURNS[0][0]])
    finally:
        close(vanilla)
    assert np.abs(plain - engine_turns[0][1]).max() > 1e-3


def test_first_seen_images_of_a_whole_batch_are_computed_alone_in_one_step(checkpoint, engine_turns, env):
    """Every turn in one generate call: one step holds the requests' side sequences (B in two of
    them), and the last request, the first's prompt again, hits the first's blocks in the same step
    with its image B half covered: the rest of B is written from the first request's side rows.
    Each request gets the engine's log-probs."""
    from vllm import SamplingParams

    metrics = env / "batch-metrics.json"
    llm = make_llm(checkpoint, {"metrics_path": str(metrics)})
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [{"prompt": re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", tokenizer.decode(ids)),
                    "multi_modal_data": {"image": [IMAGES[n] for n in names]}}
                   for (ids, _), (names, _, _) in zip(engine_turns, TURNS)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1), use_tqdm=False)
        for out, (ids, want) in zip(outs, engine_turns):
            assert list(out.prompt_token_ids) == ids
            got = np.array([lp.logprob for _, lp in sorted(out.outputs[0].logprobs[0].items())])
            np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
        m = read_metrics(metrics)
        assert m.isolated_images >= 6 and m.isolated_fallbacks == 0 and m.recomputed_tokens == 0
        assert outs[3].num_cached_tokens > 0  # the same-step prefix hit this test is about
    finally:
        close(llm)


@pytest.mark.parametrize("case, message", [
    ("chunked", "an image split by a chunk boundary cannot be computed alone; serve it with "
                "disable_chunked_mm_input=True"),
    ("top2", "keeps its top 2 layers in context, which the plugins do not serve"),
    ("rates", "nothing of it is recomputed; drop recompute_rates"),
])
def test_what_the_plugin_cannot_serve_exactly_fails_at_start_up(checkpoint, env, case, message):
    import shutil

    folder, plugin, kw = checkpoint, {}, {}
    if case == "chunked":
        kw = {"disable_chunked_mm_input": False, "enable_chunked_prefill": True}
    elif case == "top2":
        folder = str(env / "isolated-top2")
        shutil.copytree(checkpoint, folder, dirs_exist_ok=True)
        declare(folder, ImageAttention("isolated", context_layers=2))
    else:
        plugin = {"recompute_rates": [0.1, 0.1]}
    with pytest.raises(Exception, match=re.escape(message)):
        close(make_llm(folder, plugin, **kw))
