"""The vLLM plugin's step planning (samcache.integrations.vllm.step), on hand-made vLLM metadata.

No vLLM needed: plan_forward takes vLLM's attention metadata fields, the step's positions, a store
and a cache writer; the end-to-end tests through the real vLLM are in tests/vllm_plugin/.
"""

import numpy as np
import pytest
import torch

from samcache.hashing import Namespace
from samcache.recompute import TwoTrack
from samcache.integrations.vllm.config import SamcacheVllmConfig
from samcache.integrations.vllm.identity import content_identifier, store_key
from samcache.integrations.vllm.step import (ImageKV, ImageRef, RequestStep, Rotary, plan_forward)
from samcache.reuse import RecomputeBudget
from samcache.cache.stores import TensorStore

from plugin_helpers import Metadata  # noqa: E402

H, D, L, BS = 2, 8, 3, 4
SECTION = (2, 1, 1)
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
ROTARY = Rotary(INV_FREQ.float(), "mrope", SECTION)
MODEL = "vllm|tiny|float32"


def mrope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Reference sectioned M-RoPE (rotate-half) in float64: x [n, H, D], pos [3, n]."""
    axis = torch.tensor(sum(([a] * s for a, s in enumerate(SECTION)), []))
    angle = pos.double()[axis].T * INV_FREQ  # [n, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x = x.double()
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Writer:
    block_size = BS

    def __init__(self):
        self.k, self.v = {}, {}

    def write(self, layer, keys, values, slots):
        for i, s in enumerate(slots.tolist()):
            self.k[layer, s] = keys[i].clone()
            self.v[layer, s] = values[i].clone()


def image_positions(start: int, grid=(2, 3)) -> torch.Tensor:
    h, w = grid
    t = torch.full((h * w,), start)
    hh = torch.arange(h).repeat_interleave(w) + start
    ww = torch.arange(w).repeat(h) + start
    return torch.stack([t, hh, ww])


def build(tenant="t", stored_tenant="t", ratio=0.0, first_slot_ok=True, seed=0):
    """Request 0: prompt tokens [2, 16) scheduled (its prefix [0, 2) cached), a 6-token image at
    [5, 11) stored for ``stored_tenant`` from positions 20.., now at 5.. Request 1: 5 new tokens,
    no image. Flattened rows: request 0 -> 0..13, request 1 -> 14..18."""
    g = torch.Generator().manual_seed(seed)
    ns = Namespace(MODEL, stored_tenant)
    ident = content_identifier("abc123")
    key = store_key(ident, ns)
    raw_k = torch.randn(L, 6, H, D, generator=g)
    old_pos = image_positions(20)
    stored_k = torch.stack([mrope(raw_k[l], old_pos).float() for l in range(L)])
    v = torch.randn(L, 6, H, D, generator=g)
    store = TensorStore("test", 1 << 20)
    store.put(key, ImageKV(stored_k, v, old_pos), check=(6,))
    # request 0: blocks 7, 3, 9, 4 (16 tokens); request 1: blocks 1, 2
    blocks0, blocks1 = (7, 3, 9, 4), (1, 2)
    slots0 = [blocks0[p // BS] * BS + p % BS for p in range(2, 16)]
    slots1 = [blocks1[p // BS] * BS + p % BS for p in range(0, 5)]
    md = Metadata(query_start_loc=torch.tensor([0, 14, 19], dtype=torch.int32),
                  seq_lens=torch.tensor([16, 5], dtype=torch.int32),
                  slot_mapping=torch.tensor(slots0 + slots1, dtype=torch.int64),
                  block_table=torch.tensor([[7, 3, 9, 4], [1, 2, 0, 0]], dtype=torch.int32))
    # positions: text is 1-D (t = h = w); the image follows its text start
    pos0 = torch.arange(2, 16).repeat(3, 1)
    pos0[:, 3:9] = image_positions(5)
    positions = torch.cat([pos0, torch.arange(0, 5).repeat(3, 1)], dim=1)
    steps = [RequestStep("r0", 2 if first_slot_ok else 3, 14, blocks0, (ImageRef(ident, 5, 6),), tenant),
             RequestStep("r1", 0, 5, blocks1, (), tenant)]
    budget = RecomputeBudget(rates=(ratio,) * L, method=TwoTrack(relevance=False))
    writer = Writer()
    step = plan_forward(steps, attn_metadata=md, positions=positions, cache=writer, rotary=ROTARY, store=store,
                        model_id=MODEL, budget=budget, num_layers=L)
    return step, writer, raw_k, v, md, positions


def test_a_stored_image_is_rotated_to_its_new_positions_and_written_at_its_slots():
    step, writer, raw_k, v, md, positions = build()
    image_slots = md.slot_mapping[3:9].tolist()
    assert sorted({s for _, s in writer.k}) == sorted(image_slots)  # nothing else written
    want = [mrope(raw_k[l], image_positions(5)) for l in range(L)]
    for layer in range(L):
        for i, slot in enumerate(image_slots):
            torch.testing.assert_close(writer.k[layer, slot].double(), want[layer][i], atol=1e-5, rtol=0)
            assert torch.equal(writer.v[layer, slot], v[layer, i])
    # every layer computes everything but the image (ratio 0): rows 0-2, 9-18
    expect = torch.tensor([0, 1, 2, *range(9, 19)])
    assert all(torch.equal(r, expect) for r in step.rows)
    assert step.stats["image_reused_tokens"] == 6 and step.stats["computed_tokens"] == 19 - 6


def test_recompute_rows_shrink_with_depth_and_attention_runs_see_exactly_their_keys():
    budget_rates = (1.0, 0.5, 0.2)  # a layer-aware budget: nested sets, each layer's rows within the one before
    from samcache.integrations.vllm import step as step_mod

    g = torch.Generator().manual_seed(1)
    ns = Namespace(MODEL, "t")
    _, _, raw_k, v, md, positions = build()
    store = TensorStore("s", 1 << 20)
    ident = content_identifier("abc123")
    store.put(store_key(ident, ns), ImageKV(torch.randn(L, 6, H, D, generator=g), v, image_positions(20)), check=(6,))
    steps = [RequestStep("r0", 2, 14, (7, 3, 9, 4), (ImageRef(ident, 5, 6),), "t"),
             RequestStep("r1", 0, 5, (1, 2), (), "t")]
    fs = step_mod.plan_forward(steps, attn_metadata=md, positions=positions, cache=Writer(), rotary=ROTARY,
                               store=store, model_id=MODEL, budget=RecomputeBudget(rates=budget_rates, method=TwoTrack(relevance=False)),
                               num_layers=L)
    counts = [r.numel() for r in fs.rows]
    assert counts == sorted(counts, reverse=True) and counts[0] == 19 and counts[-1] < counts[1] < 19
    for layer in range(1, L):
        if fs.select[layer] is not None:
            assert torch.equal(fs.rows[layer - 1][fs.select[layer]], fs.rows[layer])
        assert set(fs.rows[layer].tolist()) <= set(fs.rows[layer - 1].tolist())
        assert {13, 18} <= set(fs.rows[layer].tolist())  # each request's last token: its logits
    # attention: every computed row attends to the keys of its own sequence up to itself, no more
    qsl, seq = md.query_start_loc.numpy(), md.seq_lens.numpy()
    for layer in range(L):
        batch = fs.attention_batch(layer, lambda b: None)
        runs_q, runs_len = batch.query_start_loc.numpy(), batch.seq_lens.numpy()
        rows = fs.rows[layer].numpy()
        for run in range(runs_len.size):
            for i in range(runs_q[run], runs_q[run + 1]):
                row = rows[i]
                req = int(np.searchsorted(qsl, row, side="right") - 1)
                position = seq[req] - (qsl[req + 1] - row)          # the row's index in its sequence
                visible = runs_len[run] - (runs_q[run + 1] - 1 - i)  # causal: keys [0, visible)
                assert visible == position + 1
                assert torch.equal(batch.block_table[run], md.block_table[req])


def test_no_hit_for_another_tenant_or_a_mismatched_step():
    step, writer, *_ = build(tenant="other")
    assert not writer.k                                   # nothing written
    assert step is not None and step.saves and step.rows is None  # the image is saved for that tenant
    step, writer, *_ = build(first_slot_ok=False)
    assert step is None and not writer.k                  # not the step the scheduler described


def test_a_missed_image_is_captured_from_the_rows_each_layer_writes():
    step, *_ = build(tenant="other")
    save = step.saves[0]
    assert save.rows.tolist() == list(range(3, 9))
    for layer in range(L):
        keys = torch.arange(19 * H * D, dtype=torch.float32).view(19, H, D) + layer
        step.capture(layer, keys, -keys)
    assert len(save.k) == L and torch.equal(save.k[1], torch.arange(19 * H * D).view(19, H, D)[3:9].float() + 1)
    # sparse: the captured rows are found among the layer's computed rows
    sparse, *_ = build(ratio=0.0)
    sparse.saves.append(type(save)(save.key, torch.tensor([0, 1, 2]), save.positions[:, :3]))
    rows = sparse.rows[0]
    sparse.capture(0, rows.float()[:, None, None].expand(-1, H, D), rows.float()[:, None, None].expand(-1, H, D))
    assert sparse.saves[0].k[0][:, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_store_keys_follow_model_tenant_and_content():
    ident = content_identifier("00ff")
    a = store_key(ident, Namespace(MODEL, "t"))
    assert a == store_key(ident, Namespace(MODEL, "t"))
    assert a != store_key(ident, Namespace(MODEL, "u"))                 # another tenant
    assert a != store_key(ident, Namespace(MODEL + "-other", "t"))      # another model
    assert a != store_key(content_identifier("00fe"), Namespace(MODEL, "t"))  # other pixels
    assert store_key("client-uuid-1", Namespace(MODEL, "t")) is None   # not a content hash: never reused
    assert store_key("samcache:", Namespace(MODEL, "t")) is None
    with pytest.raises(ValueError, match="vllm_hash must be a non-empty string"):
        content_identifier("")


def test_plugin_configuration_is_checked_with_clear_messages():
    cfg = SamcacheVllmConfig.from_extra_config({"recompute_ratio": 0.1, "tenant": "acme"})
    assert cfg.layer_rates(4) == (0.1,) * 4 and cfg.tenant == "acme"
    assert SamcacheVllmConfig.from_extra_config({"recompute_rates": [0.3, 0.2]}).layer_rates(2) == (0.3, 0.2)
    for bad, match in [({"recompute_ratoi": 0.1}, r"unknown kv_connector_extra_config key\(s\) \['recompute_ratoi'\]"),
                       ({"recompute_ratio": 1.5}, r"recompute_ratio must be a number in \[0, 1\]"),
                       ({"recompute_ratio": True}, "recompute_ratio"),
                       ({"recompute_rates": [0.1, 0.3]}, "non-increasing"),
                       ({"store_bytes": 0}, "store_bytes must be an int >= 1"),
                       ({"tenant": 3}, "tenant must be a string"),
                       ({"metrics_path": ""}, "metrics_path")]:
        with pytest.raises(ValueError, match=match):
            SamcacheVllmConfig.from_extra_config(bad)
    with pytest.raises(ValueError, match="recompute_rates has 2 entries, the model has 3"):
        SamcacheVllmConfig.from_extra_config({"recompute_rates": [0.3, 0.2]}).layer_rates(3)


def test_an_unsupported_engine_set_up_is_refused_before_anything_runs():
    from types import SimpleNamespace as NS

    from samcache.integrations.vllm.config import check_engine_config

    def config(arch="Qwen2_5_VLForConditionalGeneration", tp=1, pp=1):
        return NS(model_config=NS(hf_config=NS(architectures=[arch])),
                  parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp))

    with pytest.raises(ValueError, match=r"supports \['Qwen2_5_VLForConditionalGeneration'\], this model is "
                                         r"\['Qwen3VLMoeForConditionalGeneration'\]"):
        check_engine_config(config("Qwen3VLMoeForConditionalGeneration"))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        check_engine_config(config(tp=2))


def test_lora_and_scaled_rope_are_refused_at_start_up():
    from types import SimpleNamespace as NS

    from samcache.integrations.vllm.config import check_engine_config

    def config(lora=None, rope=None):
        text = NS(rope_parameters=rope or {"rope_type": "default", "mrope_section": [16, 24, 24]})
        return NS(model_config=NS(hf_config=NS(architectures=["Qwen2_5_VLForConditionalGeneration"], text_config=text)),
                  parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1), lora_config=lora)

    with pytest.raises(ValueError, match="does not support LoRA"):
        check_engine_config(config(lora=object()))
    with pytest.raises(ValueError, match="unscaled M-RoPE only"):
        check_engine_config(config(rope={"rope_type": "yarn", "factor": 4.0, "mrope_section": [16, 24, 24]}))


def _two_image_step(store, keep_image_order, budget=None):
    """Request 0 (rows 0..13, tokens [2, 16)): images A at [3, 6) (index 0) and B at [8, 14)
    (index 1, the one the tests store); request 1: 5 text tokens."""
    _, _, _, _, md, positions = build()
    steps = [RequestStep("r0", 2, 14, (7, 3, 9, 4), (ImageRef(content_identifier("aaa"), 3, 3),
                                                     ImageRef(content_identifier("abc123"), 8, 6)), "t"),
             RequestStep("r1", 0, 5, (1, 2), (), "t")]
    return plan_forward(steps, attn_metadata=md, positions=positions, cache=Writer(), rotary=ROTARY, store=store,
                        model_id=MODEL, budget=budget, num_layers=L, keep_image_order=keep_image_order)


def test_keep_image_order_keys_image_kv_by_content_and_index():
    from samcache.hashing import hash_bytes
    from samcache.reuse import image_key

    ns = Namespace(MODEL, "t")
    content = hash_bytes(content_identifier("abc123").encode())
    g = torch.Generator().manual_seed(3)
    entry = ImageKV(torch.randn(L, 6, H, D, generator=g), torch.randn(L, 6, H, D, generator=g), image_positions(20))
    # Stored as the first image of its prompt: at index 1 it is not reused when the order is kept...
    store = TensorStore("s", 1 << 20)
    store.put(image_key(ns, content, 0, True), entry, check=(6,))
    kept = _two_image_step(store, keep_image_order=True)
    assert kept.stats["image_reused_tokens"] == 0 and kept.rows is None
    assert {s.key for s in kept.saves} == {image_key(ns, content, 1, True),
                                           image_key(ns, hash_bytes(content_identifier("aaa").encode()), 0, True)}
    assert [s.index for s in kept.saves] == [0, 1]  # the saved entries remember their index
    # ... and it is, at any index, when the order is not kept (keyed by content alone: store_key).
    store.put(store_key(content_identifier("abc123"), ns), entry, check=(6,))
    free = _two_image_step(store, keep_image_order=False)
    assert free.stats["image_reused_tokens"] == 6 and free.stats["image_kv_hits"] == 1
    assert free.stats["image_kv_misses"] == 1  # A
    # An image vLLM did not name from its pixels (a client's uuid) is never a candidate: no miss.
    _, _, _, _, md, positions = build()
    steps = [RequestStep("r0", 2, 14, (7, 3, 9, 4), (ImageRef("client-uuid", 3, 3),
                                                     ImageRef(content_identifier("abc123"), 8, 6)), "t")]
    named = plan_forward(steps, attn_metadata=md, positions=positions, cache=Writer(), rotary=ROTARY, store=store,
                         model_id=MODEL, budget=None, num_layers=L)
    assert named.stats["image_kv_misses"] == 0 and named.stats["image_kv_hits"] == 1
    assert [s.key for s in named.saves] == []  # nothing to save: the unnamed image is never stored


def test_the_plugin_orders_recompute_by_the_same_per_request_path_as_the_engine():
    """Boundary at 0.5: the stored entry remembers index 0, the image is at index 1 (moved), so the
    first half of it is recomputed at every layer, front to back, exactly as plan_request says."""
    from samcache.recompute import Boundary
    from samcache.reuse import CachedImage, ImageSlot, PromptLayout, plan_request

    ns = Namespace(MODEL, "t")
    g = torch.Generator().manual_seed(4)
    entry = ImageKV(torch.randn(L, 6, H, D, generator=g), torch.randn(L, 6, H, D, generator=g), image_positions(20), 0)
    store = TensorStore("s", 1 << 20)
    store.put(store_key(content_identifier("abc123"), ns), entry, check=(6,))
    budget = RecomputeBudget((0.5,) * L, Boundary())
    step = _two_image_step(store, keep_image_order=False, budget=budget)
    # The same request through plan_request directly (A missed, B held at index 0).
    layout = PromptLayout(16, (ImageSlot(0, 3, 3, "A", 3), ImageSlot(1, 8, 6, "B", 8)))
    request = plan_request(layout, prefix_tokens=2, budget=budget, num_layers=L,
                           lookup=lambda s: (CachedImage(6, 20, 0), None) if s.key == "B" else None)
    assert request.plan.spliced[0].moved and request.hit_images == 1 and len(request.misses) == 1
    for layer in range(L):
        rows = set(step.rows[layer].tolist())
        recomputed = request.recompute_rows(layer) - 2  # token -> flattened row of request 0
        assert set(recomputed.tolist()) <= rows and recomputed.tolist() == [6, 7, 8]
        assert not ({9, 10, 11} & rows)  # the rest of B is spliced, not computed
    assert step.stats["recomputed_token_layers"] == request.plan.recomputed_token_layers == 3 * L


def test_plugin_settings_take_curves_and_the_order_setting(tmp_path, caplog):
    import json
    import logging

    from samcache.recompute import SensitivityCurves
    from samcache.recompute.image_order import ImageOrderCheck

    rates = np.array([0.0, 0.05, 0.1, 0.2])
    order = ImageOrderCheck(rates=rates, agreed=np.array([[90.0, 90.0], [93.0, 93.0], [95.0, 95.0], [97.0, 97.0]]),
                            confident=100, pairs=3)
    # Layer 0 repairs most, layer 2 not at all: the solved rates put the budget early.
    curves = SensitivityCurves(rates=rates, loss=np.array([[1.0, 0.5, 0.2, 0.0], [1.0, 0.9, 0.8, 0.7],
                                                           [1.0, 1.0, 1.0, 1.0]]), image_order=order)
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(curves.to_dict("whatever")))
    cfg = SamcacheVllmConfig.from_extra_config({"recompute_ratio": 0.1, "sensitivity": str(path)})
    assert cfg.keep_image_order == "auto" and cfg.keeps_image_order(3)  # agreement 0.95 < 0.99: keep it
    assert cfg.layer_rates(3) == (0.2, 0.1, 0.0)  # as the engine solves them
    assert not SamcacheVllmConfig.from_extra_config({"sensitivity": str(path), "keep_image_order": False}
                                                    ).keeps_image_order(3)
    assert not any("no reuse profile or curves" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.INFO, logger="samcache"):
        assert SamcacheVllmConfig.from_extra_config({}).keeps_image_order(3)  # auto without curves: order kept
    assert [r.levelname for r in caplog.records if "no reuse profile or curves" in r.getMessage()] == ["INFO"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="samcache"):
        assert SamcacheVllmConfig.from_extra_config({"keep_image_order": True}).keeps_image_order(3)
        assert not SamcacheVllmConfig.from_extra_config({"keep_image_order": False}).keeps_image_order(3)
    assert not caplog.records  # an explicit setting is not warned about
    with pytest.raises(ValueError, match="keep_image_order must be True, False or 'auto'"):
        SamcacheVllmConfig.from_extra_config({"keep_image_order": "yes"})
    with pytest.raises(ValueError, match="sensitivity must be the path of a curves JSON"):
        SamcacheVllmConfig.from_extra_config({"sensitivity": 3})
    with pytest.raises(ValueError, match="sensitivity curves have 3 layers, the model has 4"):
        cfg.layer_rates(4)
    with pytest.raises(ValueError, match="cannot read the curves file"):
        SamcacheVllmConfig.from_extra_config({"sensitivity": str(tmp_path / "none.json")}).layer_rates(3)
