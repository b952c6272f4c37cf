"""samcache's Qwen2.5-VL and Qwen3-VL-MoE overrides, run as SGLang's own model classes on a tiny config through SGLang's
real pools, ForwardBatch and RadixAttention (tests/sglang_plugin/sglang_harness.py).

A first request stores its images; a second one carries the same images after another prefix (new
positions). At recompute ratio 1.0 its logits equal the stock model's (SGLang's class, its
torch_native backend); at 0.05 they match within a next-token KL of 0.05 while the decoder computes
far fewer rows. Other pixels, another tenant or another model never reuse.
"""

from __future__ import annotations

import pytest
import torch

import sglang_harness as H
from samcache.hashing import hash_bytes
from samcache.integrations.settings import ReuseSettings
from samcache.integrations.sglang.attention import SamcacheAttnBackend
from samcache.integrations.sglang.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Qwen25Override
from samcache.integrations.sglang.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration as Qwen3MoeOverride
from samcache.integrations.sglang.reuse import ModelReuse
from samcache.cache.stores import TensorStore

GRID_A, GRID_B = (1, 8, 8), (1, 8, 12)  # 16 and 24 image tokens

# Per architecture: its tiny config, SGLang's class, samcache's override, the weights' source.
ARCHS = {
    "qwen2_5_vl": (H.tiny_qwen2_5_vl_config, H.build_qwen2_5_vl, Qwen25Override, H.hf_reference_qwen2_5_vl),
    "qwen3_vl_moe": (H.tiny_qwen3_vl_moe_config, H.build_qwen3_vl_moe, Qwen3MoeOverride,
                     lambda c, s: H._CheckpointLayoutState(H.hf_reference_qwen3_vl_moe(c, s))),
}


@pytest.fixture(autouse=True)
def fresh_vit_cache():
    """SGLang's ViT-output cache is per process and keyed by pixels: a test's models must not read
    another test's (differently seeded) vision outputs."""
    H.setup_sglang()
    H.reset_mm_embedding_cache()


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    H.setup_sglang()
    make_config, build_stock, override_cls, weights = ARCHS[request.param]
    config = make_config()
    return config, build_stock(config, seed=0), override_cls, weights


def _override(arch, settings: ReuseSettings, store=None, seed=0):
    config, _, override_cls, weights = arch
    model = H._build_from_hf(override_cls, config, seed, weights)
    model._samcache_reuse = ModelReuse(model, settings, store if store is not None else TensorStore("t", 1 << 28))
    return model


def _prompts(config, *, first_prefix, second_prefix, pixel_seed=0, second_seed=None):
    first = H.prompt_with_images(config, [first_prefix, GRID_A, [7, 8, 9], GRID_B, [10, 11, 12]], seed=pixel_seed)
    second = H.prompt_with_images(config, [second_prefix, GRID_B, [20, 21], GRID_A, [13, 14, 15, 16]],
                                  seed=pixel_seed if second_seed is None else second_seed)
    # The second prompt's images are the first's in another order: swap their pixels to match.
    ids, items = second
    if second_seed is None:
        items[0].feature, items[1].feature = first[1][1].feature.clone(), first[1][0].feature.clone()
    return first, (ids, items)


def _run(model, prompt, backend_factory=None, pools=None):
    """One request's extend step (SGLang samples its last row: no full hidden-state capture)."""
    pools = pools or H.Pools.for_model(model, backend_factory=backend_factory)
    req = H.Request.create(model, pools, *prompt)
    out = H.run_batch(model, pools, [req.extend()], capture_full_hidden=False)
    return out, req, pools


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double().flatten(), 0)
    q = torch.log_softmax(q_logits.double().flatten(), 0)
    return float((p.exp() * (p - q)).sum())


def _reuse_second(arch, settings, **prompt_kw):
    config, stock = arch[0], arch[1]
    model = _override(arch, settings)
    first, second = _prompts(config, **prompt_kw)
    _run(model, first, SamcacheAttnBackend)                     # stores both images
    assert len(model._samcache_reuse.store) == 2
    got, req, pools = _run(model, second, SamcacheAttnBackend)
    want, _, _ = _run(stock, second)
    return model, got, want, req, pools


def test_ratio_one_equals_stock_model(arch):
    model, got, want, _, _ = _reuse_second(arch, ReuseSettings(keep_image_order=False, recompute_ratio=1.0),
                                           first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8])
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)


def test_reuse_at_new_positions_within_kl(arch):
    from samcache.integrations.sglang.reuse import reset_stats, stats

    reset_stats()
    model, got, want, req, pools = _reuse_second(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.05),
                                                 first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8, 9, 30])
    s = stats()
    assert s.image_kv_hits == 2 and s.images_saved == 2 and s.image_reused_tokens == 40
    assert s.computed_tokens < s.prompt_tokens  # spliced rows skipped by the decoder
    kl = _kl(want.next_token_logits, got.next_token_logits)
    print(f"next-token KL {kl:.2e}; decoder rows {s.computed_tokens} of {s.prompt_tokens}")
    assert kl < 0.05, kl
    # Decoding continues on the spliced cache.
    token = int(got.next_token_logits.argmax())
    step = H.run_batch(model, pools, [req.decode(token)], mode="decode", capture_full_hidden=False)
    assert torch.isfinite(step.next_token_logits).all()


def test_other_pixels_are_not_reused(arch):
    from samcache.integrations.sglang.reuse import reset_stats, stats

    reset_stats()
    model, got, want, _, _ = _reuse_second(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0),
                                           first_prefix=[1, 2, 3], second_prefix=[4, 5], second_seed=99)
    assert stats().image_kv_hits == 0
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)


def test_other_tenant_or_model_is_not_reused(arch):
    config, stock = arch[0], arch[1]
    store = TensorStore("shared", 1 << 28)
    first, second = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4, 5])
    acme = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0, tenant="acme"), store)
    _run(acme, first, SamcacheAttnBackend)
    other = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0, tenant="globex"), store)
    before = len(store)
    got, _, _ = _run(other, second, SamcacheAttnBackend)
    want, _, _ = _run(stock, second)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)
    assert len(store) == before + 2  # globex computed and stored its own
    # The same weights under another checkpoint name is another model.
    renamed = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0, tenant="acme"), store)
    renamed._samcache_reuse.model_id += "|other-checkpoint"
    got, _, _ = _run(renamed, second, SamcacheAttnBackend)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)
    # A request's extra_key and cache_salt join its tenant: same configured tenant, other salt, other keys.
    content = hash_bytes(b"an image")
    salted = acme._samcache_reuse.namespace_of(type("FB", (), {"samcache_extra_keys": [(None, "salt-1")]})())
    plain = acme._samcache_reuse.namespace_of(type("FB", (), {})())
    assert salted(0).key(content) != plain(0).key(content)


def test_batch_mixes_reuse_and_plain_requests(arch):
    config, stock = arch[0], arch[1]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=1.0))
    first, second = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4, 5, 6])
    _run(model, first, SamcacheAttnBackend)
    text_only = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [])
    pools = H.Pools.for_model(model, backend_factory=SamcacheAttnBackend)
    reqs = [H.Request.create(model, pools, *second), H.Request.create(model, pools, text_only[0], None)]
    got = H.run_batch(model, pools, [r.extend() for r in reqs], capture_full_hidden=False)
    for i, prompt in enumerate([second, (text_only[0], None)]):
        want, _, _ = _run(stock, prompt)
        torch.testing.assert_close(got.next_token_logits[i], want.next_token_logits[0], atol=1e-4, rtol=1e-4)


def test_other_backend_falls_back_to_sglang(arch):
    config, stock = arch[0], arch[1]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0))
    first, second = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4, 5])
    _run(model, first)              # torch_native: the override stays SGLang's own path
    assert len(model._samcache_reuse.store) == 0
    got, _, _ = _run(model, second)
    want, _, _ = _run(stock, second)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=0, rtol=0)


def test_one_layer_model_splice_is_exact():
    """With one decoder layer an image's keys and values depend only on its pixels and positions:
    spliced at new positions with nothing recomputed, the logits must equal the stock model's (this
    fails if the keys are not re-rotated to their new M-RoPE positions, or land in wrong slots)."""
    cfg = H.tiny_qwen2_5_vl_config(text_config={"num_hidden_layers": 1})
    stock = H.build_qwen2_5_vl(cfg, seed=3)
    model = _override((cfg, stock, Qwen25Override, H.hf_reference_qwen2_5_vl), ReuseSettings(keep_image_order=False, recompute_ratio=0.0),
                      seed=3)
    first, second = _prompts(cfg, first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8, 9, 10, 11])
    _run(model, first, SamcacheAttnBackend)
    from samcache.integrations.sglang.reuse import reset_stats, stats

    reset_stats()
    got, _, _ = _run(model, second, SamcacheAttnBackend)
    want, _, _ = _run(stock, second)
    s = stats()
    assert s.image_kv_hits == 2 and s.recomputed_tokens == 0 and s.computed_tokens == s.prompt_tokens - 40
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)


def test_spliced_first_layer_kv_equals_computed(arch):
    """The first layer's keys and values of an image depend only on its pixels and positions: the
    spliced ones (cached at other positions, re-rotated with the architecture's M-RoPE: sectioned
    for Qwen2.5-VL, interleaved for Qwen3-VL) must equal what the stock model computes in place."""
    config, stock = arch[0], arch[1]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0))
    first, second = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8, 9, 10])
    _run(model, first, SamcacheAttnBackend)
    _, got_req, got_pools = _run(model, second, SamcacheAttnBackend)
    _, want_req, want_pools = _run(stock, second)
    ids = torch.tensor(second[0])
    image_rows = torch.nonzero(ids == config.image_token_id).flatten()
    assert image_rows.numel() == 40
    for pools, req, name in ((got_pools, got_req, "got"), (want_pools, want_req, "want")):
        slots = pools.req_to_token[req.row, image_rows].long()
        kv = (pools.token_to_kv_pool.get_key_buffer(0)[slots], pools.token_to_kv_pool.get_value_buffer(0)[slots])
        if name == "got":
            got_kv = kv
        else:
            want_kv = kv
    torch.testing.assert_close(got_kv[0], want_kv[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_kv[1], want_kv[1], atol=2e-5, rtol=2e-5)


def test_rows_shrinking_with_depth_are_exact_for_an_identical_context(arch):
    """Layer-aware rates (every image row recomputed at the first layer, fewer deeper): the layer
    stack runs on row sets that shrink, so SGLang's residual stream is gathered between layers. The
    same prompt sent again as a new request (no prefix hit) has the same context at the same
    positions, so the spliced KV is exactly what would be computed: the logits must equal the stock
    model's."""
    config, stock = arch[0], arch[1]
    layers = H.text_config_of(stock).num_hidden_layers
    rates = [1.0] + [0.5] * (layers - 2) + [0.0]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_rates=rates))
    first, _ = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4])
    _run(model, first, SamcacheAttnBackend)
    from samcache.integrations.sglang.reuse import reset_stats, stats

    reset_stats()
    got, _, _ = _run(model, first, SamcacheAttnBackend)
    want, _, _ = _run(stock, first)
    s = stats()
    assert s.image_kv_hits == 2 and s.recomputed_tokens == 40           # every image row at the first layer
    assert s.recomputed_token_layers < 40 * layers                      # fewer deeper: rows were gathered
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)


def test_metrics_path_is_written_after_each_step(arch, tmp_path):
    import json

    from samcache.integrations.sglang.reuse import reset_stats

    reset_stats()
    path = tmp_path / "samcache-metrics.json"
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.05, metrics_path=str(path)))
    first, second = _prompts(arch[0], first_prefix=[1, 2, 3], second_prefix=[4, 5])
    _run(model, first, SamcacheAttnBackend)
    assert json.loads(path.read_text())["images_saved"] == 2
    _run(model, second, SamcacheAttnBackend)
    written = json.loads(path.read_text())
    assert written["image_kv_hits"] == 2 and written["steps"] == 2 and written["image_reused_tokens"] == 40


def test_workflow_policy_keeps_the_images_of_the_agents_that_run_next(arch):
    """Three agents, one screenshot each, a store with room for two. Requests name their agent
    with SGLang's ``routing_key`` (recorded by the plugin's batch hook): under LRU the cycle
    misses every time; the workflow-aware policy keeps the images of the agents that run soonest."""
    import types

    from samcache.integrations import sglang as plugin
    from samcache.integrations.sglang.reuse import reset_stats, stats

    config = arch[0]
    agents = ("a1", "a2", "a3")
    prompts = {a: H.prompt_with_images(config, [[1 + i, 2, 3], GRID_A, [7, 8, 9]], seed=10 + i)
               for i, a in enumerate(agents)}
    probe = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0))
    _run(probe, prompts["a1"], SamcacheAttnBackend)
    image_bytes = probe._samcache_reuse.store.used_bytes
    assert image_bytes > 0
    team = {"eviction_policy": "workflow", "eviction_options": {"workflows": [{"name": "team", "agents": list(agents)}]}}
    reused = {}
    for name, extra in (("lru", {}), ("workflow", team)):
        settings = ReuseSettings.from_mapping({"recompute_ratio": 0.0, **extra}, source="test")
        model = _override(arch, settings, TensorStore("t", int(2.5 * image_bytes)))
        reused[name] = 0
        for r in range(3):
            for k, a in enumerate(agents):
                reset_stats()
                pools = H.Pools.for_model(model, backend_factory=SamcacheAttnBackend)
                req = H.Request.create(model, pools, *prompts[a])
                batch = types.SimpleNamespace(reqs=[types.SimpleNamespace(rid=f"req-{r}-{k}", routing_key=f"team/{a}",
                                                                          extra_key=None, cache_salt=None)])
                H.run_batch(model, pools, [req.extend()], capture_full_hidden=False,
                            after_init=lambda fb: plugin._record_extra_keys(fb, object, batch))
                reused[name] += stats().image_kv_hits
    assert reused["lru"] == 0  # three images cycling through room for two
    assert reused["workflow"] >= 3, reused


def test_the_plugin_plans_through_the_shared_per_request_path_with_the_order_kept(arch, monkeypatch):
    """With keep_image_order the two images, shown again swapped, are not reused (each is at another
    index) but computed and stored again under their new index; the plan goes through
    samcache.reuse.plan_request (the engine's per-request path)."""
    import samcache.integrations.forward_plan as forward_plan
    from samcache.integrations.sglang.reuse import reset_stats, stats

    calls = []
    real = forward_plan.plan_request
    monkeypatch.setattr(forward_plan, "plan_request", lambda *a, **k: calls.append(k["prefix_tokens"]) or real(*a, **k))
    reset_stats()
    _reuse_second(arch, ReuseSettings(recompute_ratio=0.05, recompute_method="boundary", keep_image_order=True),
                  first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8, 9, 30])
    assert len(calls) == 2  # one request a forward, both forwards
    s = stats()
    assert s.image_kv_hits == 0 and s.image_reused_tokens == 0 and s.image_kv_misses == 4 and s.images_saved == 4


def test_an_image_the_prefix_holds_in_part_is_spliced_from_its_first_uncached_token(arch):
    """A radix hit that ends inside an image (pages of several tokens, or a partly evicted node):
    the image's tail is spliced from the store, as samcache's engine does, not computed again. Same
    index and positions as when stored, ratio 0: exact."""
    from samcache.integrations.sglang.reuse import reset_stats, stats

    config, stock = arch[0], arch[1]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.0))
    first, _ = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4])
    ids, items = first
    second = (list(ids) + [40, 41, 42], items)  # the same prompt, then more text
    b_start, b_end = items[1].offsets[0]
    hit = b_start + 5  # the prefix holds image B's first 5 tokens

    def run(m, factory):
        pools = H.Pools.for_model(m, backend_factory=factory)
        cached = H.Request.create(m, pools, *first)
        H.run_batch(m, pools, [cached.extend()], capture_full_hidden=False)  # stores A and B
        req = H.Request.create(m, pools, *second)
        pools.copy_prefix(cached.row, req.row, hit)
        req.kv_len = hit
        reset_stats()
        return H.run_batch(m, pools, [req.extend()], capture_full_hidden=False)

    got = run(model, SamcacheAttnBackend)
    s = stats()
    tail = b_end + 1 - hit
    assert s.image_kv_hits == 1 and s.image_reused_tokens == tail and s.image_kv_misses == 0
    assert s.computed_tokens == s.prompt_tokens - tail  # the tail's rows were skipped, not computed
    want = run(stock, None)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)


def test_a_splice_marks_the_request_with_its_exact_tokens(arch):
    """The batch hook hands the step its requests; a step that splices at recompute < 1 marks the
    request with its leading exact tokens (the tree keeps no more of it); a step that splices
    nothing leaves it unmarked."""
    import types

    from samcache.integrations import sglang as plugin
    from samcache.integrations.sglang.exactness import exact_tokens

    config = arch[0]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.05))
    first, second = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8, 9, 30])
    reqs = {}
    for name, prompt in (("first", first), ("second", second)):
        pools = H.Pools.for_model(model, backend_factory=SamcacheAttnBackend)
        req = H.Request.create(model, pools, *prompt)
        reqs[name] = types.SimpleNamespace(rid=name, routing_key=None, extra_key=None, cache_salt=None)
        batch = types.SimpleNamespace(reqs=[reqs[name]])
        H.run_batch(model, pools, [req.extend()], capture_full_hidden=False,
                    after_init=lambda fb: plugin._record_extra_keys(fb, object, batch))
    assert exact_tokens(reqs["first"]) is None  # computed whole: exact
    first_image = second[1][0].offsets[0][0]
    assert exact_tokens(reqs["second"]) == first_image  # approximate from the first spliced token


def test_with_another_prefix_tree_the_override_splices_nothing(arch, monkeypatch, caplog):
    """Inside a server whose prefix tree is not samcache's, spliced KV would be served as exact: the
    override computes every image as SGLang does (and says so once)."""
    import samcache.integrations.sglang.reuse as reuse

    monkeypatch.setattr(reuse, "tree_keeps_approximate_out", lambda: False)
    config, stock = arch[0], arch[1]
    model = _override(arch, ReuseSettings(keep_image_order=False, recompute_ratio=0.05))
    first, second = _prompts(config, first_prefix=[1, 2, 3], second_prefix=[4, 5, 6, 7, 8, 9, 30])
    reuse.reset_stats()
    with caplog.at_level("WARNING", logger="sglang.samcache"):
        _run(model, first, SamcacheAttnBackend)
        got, _, _ = _run(model, second, SamcacheAttnBackend)
    want, _, _ = _run(stock, second)
    assert len(model._samcache_reuse.store) == 0 and reuse.stats().image_reused_tokens == 0
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=1e-4)
    assert sum("would serve spliced, approximate KV as exact" in r.message for r in caplog.records) == 1


def test_the_tree_check_reads_the_servers_memory_settings(arch, monkeypatch):
    import types

    import sglang.srt.runtime_context as runtime_context

    from samcache.integrations.sglang.exactness import tree_keeps_approximate_out

    assert tree_keeps_approximate_out() is True  # the harness's server runs without a prefix tree
    for disabled, backend, safe in ((False, None, False), (False, "samcache", True), (True, None, True)):
        memory = types.SimpleNamespace(disable_radix_cache=disabled, radix_cache_backend=backend)
        monkeypatch.setattr(runtime_context, "get_memory", lambda: memory)
        assert tree_keeps_approximate_out() is safe, (disabled, backend)
