"""Visual-token compression in the engine (tiny Qwen3-VL-MoE, CPU).

The compressed prefill is checked against a plain reference written here: transformers' own
decoder layers over a dense causal mask, every layer given only the tokens it still holds, the
merge done with the same policy functions on the reference's own router logits. The runner's
compacted slots, per-layer metadata, DeepStack merge and decode rows are what is under test.
The reference's RMS norms are the engine's kernel (tested alone in test_ops_rms_norm.py): on
random weights an ulp of difference there can flip an expert or an anchor choice.
"""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from samcache.compression import Compaction, CompressionSettings, RouterScores, anchor_count, plan_stage  # noqa: E402
from samcache import Namespace  # noqa: E402
from samcache.engine import screenshot  # noqa: E402
from samcache.engine.executor import RequestOptions  # noqa: E402
from samcache.engine.metrics import TurnMetrics  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402

from engine_helpers import SIZE, assert_clean, make_engine  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_vl_moe", "internvl"])
def moe(tiny_checkpoints, request):
    """Both MoE families: Qwen3-VL-MoE (M-RoPE, DeepStack) and InternVL3.5 with Qwen3-MoE (1-D
    RoPE, tiles: the merge reads the tokens' grid from positions rows 1-2 there too)."""
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def plain(moe):
    return make_engine(moe)


def prompt_of(engine, seeds=(1, 2), question="What is on the screen?"):
    msgs = [{"role": "system", "content": "Be brief."},
            user_message([screenshot(s, SIZE) for s in seeds], question)]
    return engine.build_prompt(msgs)


@contextlib.contextmanager
def engine_norms(runner):
    """The decoder's RMS norm modules computed by the kernel the runner uses for them."""
    from samcache import ops

    if not runner.fused_norms:
        yield
        return
    norms = [m for layer in runner.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(runner.text.norm)
    for m in norms:
        m.forward = lambda x, m=m: ops.rms_norm(x.reshape(-1, x.shape[-1]), m.weight, m.variance_epsilon).view(x.shape)
    try:
        yield
    finally:
        for m in norms:
            del m.forward


def reference_logits(engine, prompt, settings: CompressionSettings, forced: dict | None = None,
                     planned: dict | None = None) -> torch.Tensor:
    """Next-token logits of ``prompt`` with compression, computed densely layer by layer.
    ``forced``: image index -> {layer: (positions, target positions, weights)}, merges to apply
    instead of planning them from the router logits. ``planned`` (filled when given): (image
    index, layer) -> {position: target position} of the merges the reference planned itself."""
    with engine_norms(engine.runner):
        return _reference_logits(engine, prompt, settings, forced, planned)


def _reference_logits(engine, prompt, settings: CompressionSettings, forced: dict | None,
                      planned: dict | None) -> torch.Tensor:
    runner, ex = engine.runner, engine.executor
    n = len(prompt)
    vit: dict = {}
    ex.vit.ensure(prompt, range(len(prompt.images)), vit, TurnMetrics(), RequestOptions(use_vit=False, store_vit=False),
                  Namespace("reference"))
    with torch.no_grad():
        h = ex.embeds(prompt, np.arange(n), vit).clone()
        cos, sin = runner.rope(prompt.positions, h)
        deep = [torch.zeros(n, runner.hidden_size) for _ in range(runner.deepstack_layers)]
        for span in prompt.images:
            for d in range(runner.deepstack_layers):
                deep[d][span.start:span.end] = vit[span.index][1][d]
        visual = np.zeros(n, dtype=bool)
        for span in prompt.images:
            visual[span.start:span.end] = True
        alive = [np.arange(n)]  # positions each layer still holds
        groups = {s.index: np.arange(s.start, s.end) for s in prompt.images}  # each image's kept tokens
        for l, layer in enumerate(runner.layers):
            keep = alive[-1]
            t = torch.from_numpy(keep)
            mask = torch.full((keep.size, keep.size), float("-inf")).triu(1)[None, None]
            captured = []
            hook = layer.mlp.register_forward_hook(lambda m, inp, out: captured.append(inp[0]))
            try:
                out = layer(h[t][None], attention_mask=mask, position_embeddings=(cos[t][None], sin[t][None]))
            finally:
                hook.remove()
            x = out[0] if isinstance(out, tuple) else out
            x = x[0]
            if l < runner.deepstack_layers:
                vis = torch.from_numpy(np.flatnonzero(visual[keep]))
                x[vis] += deep[l][t][vis]
            h[t] = x
            if l in settings.layers:
                normed = captured[0].reshape(-1, runner.hidden_size)
                frac = settings.keep_at(l)
                for index, members in groups.items():
                    if forced is not None and index in forced:
                        stage = forced[index].get(l)
                        if stage is None:
                            continue
                        assert np.array_equal(stage[0], members)
                        target = torch.from_numpy(np.searchsorted(members, stage[1]))
                        w = torch.from_numpy(stage[2]).double()
                        anchors = torch.nonzero(target == torch.arange(members.size)).flatten()
                        plan = SimpleNamespace(target=target)
                    else:
                        if anchor_count(members.size, frac) == members.size:
                            continue
                        local = torch.from_numpy(np.searchsorted(keep, members))
                        logits = torch.nn.functional.linear(normed[local], layer.mlp.gate.weight)
                        coords = prompt.positions[1:3, torch.from_numpy(members)].T
                        plan = plan_stage(RouterScores.from_logits(logits.float()), coords, frac, spread=settings.spread)
                        w = plan.weight.double()
                        anchors = plan.anchors
                        if planned is not None:
                            planned[index, l] = dict(zip(members.tolist(), members[plan.target.numpy()].tolist()))
                    rows = torch.from_numpy(members)
                    for a in anchors.tolist():  # the weighted mean of each anchor's group, in float64
                        grp = (plan.target == a).nonzero().flatten()
                        wts = w[grp] / w[grp].sum()
                        h[rows[a]] = (h[rows[grp]].double() * wts[:, None]).sum(0).to(h.dtype)
                        for d in range(l + 1, runner.deepstack_layers):
                            deep[d][rows[a]] = (deep[d][rows[grp]].double() * wts[:, None]).sum(0).to(h.dtype)
                    groups[index] = members[anchors.numpy()]
                gone = np.setdiff1d(np.concatenate([np.arange(s.start, s.end) for s in prompt.images]),
                                    np.concatenate(list(groups.values())))
                alive.append(np.setdiff1d(keep, gone))
            else:
                alive.append(keep)
        last = runner.text.norm(h[n - 1:])
        return torch.nn.functional.linear(last, runner.lm_head.weight).float()[0]


def test_compaction_maps_positions_to_compacted_slots():
    c = Compaction(4)
    c.remove(2, np.array([3, 5, 6]))
    c.remove(3, np.array([8]))
    assert not c.removed[1].size and c.removed[2].tolist() == [3, 5, 6] and c.removed[3].tolist() == [3, 5, 6, 8]
    assert c.kept(3, np.arange(10)).tolist() == [0, 1, 2, 4, 7, 9]
    assert c.slots(3, np.array([0, 2, 4, 7, 9])).tolist() == [0, 2, 3, 4, 5]
    assert c.slots(1, np.array([4, 7])).tolist() == [4, 7]
    assert c.tokens_per_layer(10) == [10, 10, 7, 6]
    with pytest.raises(ValueError, match="from_layer"):
        c.remove(0, np.array([1]))


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_compressed_prefill_matches_dense_reference(moe, keep):
    engine = make_engine(moe, compression_enabled=True, compression_keep=keep)
    prompt = prompt_of(engine)
    pre, logits = engine.prefill(prompt)
    try:
        assert pre.metrics.compressed_images == 2
        assert pre.metrics.layer_tokens[0] == len(prompt) > pre.metrics.layer_tokens[-1]
    finally:
        engine.pool.free_sequence(pre.seq)
    # The engine's merges are the reference's own plan (from its own router logits) but for
    # near-ties: on random weights an ulp of difference can decide an anchor.
    planned: dict = {}
    own = reference_logits(engine, prompt, engine.compression, planned=planned)
    forced: dict = {}
    same = total = 0
    for layer, positions, targets, weights in pre.compaction.merges:
        span = next(s for s in prompt.images if s.start <= positions[0] < s.end)
        forced.setdefault(span.index, {})[layer] = (positions, targets, weights)
        theirs = planned.get((span.index, layer), {})
        same += sum(theirs.get(p) == t for p, t in zip(positions.tolist(), targets.tolist()))
        total += len(positions)
    assert total and same >= 0.9 * total, f"the engine's merges differ from the reference's plan: {same} of {total} agree"
    if same == total:
        torch.testing.assert_close(logits, own, atol=2e-4, rtol=1e-4)
    # With the engine's merges, the compacted forward is the dense one.
    ref = reference_logits(engine, prompt, engine.compression, forced=forced)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
    assert_clean(engine)


def test_keep_one_is_bit_identical_to_no_compression(moe, plain):
    engine = make_engine(moe, compression_enabled=True, compression_keep=1.0)
    msgs = [user_message([screenshot(3, SIZE), screenshot(4, SIZE)], "Which one is newer?")]
    a = plain.chat(messages=msgs, max_new_tokens=6, ignore_eos=True)
    b = engine.chat(messages=msgs, max_new_tokens=6, ignore_eos=True)
    assert a.token_ids == b.token_ids
    prompt = plain.build_prompt(msgs)
    pa, la = plain.prefill(prompt, options=RequestOptions(use_prefix=False, use_image_kv=False, register_prefix=False))
    pb, lb = engine.prefill(prompt, options=replace_options(engine, use_prefix=False, use_image_kv=False,
                                                            register_prefix=False))
    plain.pool.free_sequence(pa.seq)
    engine.pool.free_sequence(pb.seq)
    assert torch.equal(la, lb)


def replace_options(engine, **kw):
    from dataclasses import replace

    return replace(engine.request_options(), **kw)


def test_decode_after_compressed_prefill_equals_prefill_of_the_longer_prompt(moe):
    """A decode row at compacted slots sees what a prefill of prompt + token computes."""
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25)
    prompt = prompt_of(engine, seeds=(5, 6))
    r = engine.chat(messages=[{"role": "system", "content": "Be brief."},
                              user_message([screenshot(5, SIZE), screenshot(6, SIZE)], "What is on the screen?")],
                    max_new_tokens=4, ignore_eos=True, fidelity=True)
    assert r.metrics.compressed_images == 2 and r.metrics.fidelity is not None
    # The same turn token by token: prefill of prompt + the first tokens, next-token argmax.
    options = replace_options(engine, use_prefix=False, use_image_kv=False, register_prefix=False, store_images=False)
    for i, token in enumerate(r.token_ids[:-1]):
        longer = extend_prompt(prompt, r.token_ids[: i + 1])
        pre, logits = engine.prefill(longer, options=options)
        engine.pool.free_sequence(pre.seq)
        assert int(logits.argmax()) == r.token_ids[i + 1]
    assert_clean(engine)


def extend_prompt(prompt, tokens):
    """``prompt`` followed by generated ``tokens`` (text positions continue after the prompt)."""
    from dataclasses import replace

    extra = torch.arange(prompt.next_position, prompt.next_position + len(tokens))
    return replace(prompt, token_ids=np.concatenate([prompt.token_ids, np.asarray(tokens, dtype=prompt.token_ids.dtype)]),
                   positions=torch.cat([prompt.positions, extra.expand(3, -1)], dim=1),
                   next_position=prompt.next_position + len(tokens))


def test_batched_compressed_requests_equal_each_alone(moe):
    from samcache.engine.api import ChatRequest

    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25, cache_enabled=False)
    reqs = [ChatRequest(images=[screenshot(7 + i, SIZE)], prompt=f"question {i}", max_new_tokens=3, ignore_eos=True)
            for i in range(3)]
    together = engine.chat_batch(reqs)
    alone = [engine.chat(images=[screenshot(7 + i, SIZE)], prompt=f"question {i}", max_new_tokens=3, ignore_eos=True)
             for i in range(3)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert_clean(engine)


def test_prefix_cache_stops_at_the_first_compressed_image(moe):
    """Blocks holding compacted rows never enter the prefix cache; the text before the image does."""
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25)
    system = "You are a careful assistant. " * 6
    first = [{"role": "system", "content": system}, user_message([screenshot(11, SIZE)], "first")]
    engine.chat(messages=first, max_new_tokens=2)
    prompt = engine.build_prompt(first)
    pre, _ = engine.prefill(prompt)
    engine.pool.free_sequence(pre.seq)
    start = prompt.images[0].start
    assert 0 < pre.metrics.prefix_reused_tokens <= start
    assert pre.metrics.prefix_reused_tokens == start // engine.pool.block_size * engine.pool.block_size
    assert_clean(engine)


def test_bad_compression_arguments_raise(moe, tiny_checkpoints):
    with pytest.raises(ValueError, match="keep ratio"):
        make_engine(moe, compression_enabled=True, compression_keep=0.0)
    with pytest.raises(ValueError, match="keep ratio"):
        make_engine(moe, compression_enabled=True, compression_keep=1.5)
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
        make_engine(moe, compression_enabled=True, compression_layers=[0, 2])
    with pytest.raises(ValueError, match="strictly increasing"):
        make_engine(moe, compression_enabled=True, compression_layers=[1, 0])
    with pytest.raises(ValueError, match="MoE"):
        make_engine(tiny_checkpoints["qwen2_5_vl"], compression_enabled=True)
    with pytest.raises(TypeError, match="compression_enabled"):
        make_engine(moe, compression_enabled="yes")


def compressed_options(engine, **kw):
    return replace_options(engine, **kw)


def test_resent_image_reuses_its_compressed_kv_exactly(moe):
    """Same context before the image, other text after it: the packed record spliced back equals
    the compressed prefill of the new prompt (the image's KV is the same), at every layer."""
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25, recompute_ratio=0.0)
    image = screenshot(21, SIZE)
    first = [{"role": "system", "content": "Be brief."}, user_message([image], "What is on the screen?")]
    engine.chat(messages=first, max_new_tokens=1)
    held = list(engine.image_kv_store.entries.payloads())
    assert len(held) == 1 and held[0].packed
    layers = engine.runner.num_layers
    assert held[0].layer_rows(layers) < 0.6 * held[0].length * layers  # packed: fewer rows than the whole image
    assert engine.image_kv_store.used_bytes < 0.75 * -(-held[0].length // engine.pool.block_size) * engine.runner.block_bytes

    second = [{"role": "system", "content": "Be brief."}, user_message([image], "Where is the red button?")]
    prompt = engine.build_prompt(second)
    pre, logits = engine.prefill(prompt)
    engine.pool.free_sequence(pre.seq)
    assert pre.metrics.image_kv_hits == 1 and pre.metrics.image_reused_tokens == prompt.images[0].length
    assert pre.metrics.layer_tokens[-1] < len(prompt)
    ref_pre, ref = engine.prefill(prompt, options=compressed_options(engine, use_prefix=False, use_image_kv=False,
                                                                       register_prefix=False, store_images=False))
    engine.pool.free_sequence(ref_pre.seq)
    assert ref_pre.metrics.compressed_images == 1
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert_clean(engine)


def test_compressed_record_moves_and_recomputes_only_before_its_first_stage(moe):
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25, recompute_ratio=0.2)
    a, b = screenshot(31, SIZE), screenshot(32, SIZE)
    engine.chat(images=[a], prompt="first", max_new_tokens=1)
    # A new image before it: a moves; b is new and compressed after it.
    r = engine.chat(messages=[{"role": "system", "content": "Other context, longer than before."},
                              user_message([b, a], "compare")], max_new_tokens=3, ignore_eos=True, fidelity=True)
    m = r.metrics
    assert m.image_kv_hits == 1 and m.compressed_images == 1 and m.recomputed_tokens > 0
    assert m.fidelity is not None and np.isfinite(m.fidelity.kl)
    assert len(engine.image_kv_store) == 2 and all(h.packed for h in engine.image_kv_store.entries.payloads())
    assert_clean(engine)


def test_compressed_and_plain_records_never_mix(moe):
    """A record made with other compression settings (or none) is a miss, not a wrong hit."""
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25)
    image = screenshot(41, SIZE)
    engine.chat(images=[image], prompt="first", max_new_tokens=1)
    prompt = engine.build_prompt([user_message([image], "again")])
    plain = replace_options(engine, compression=None, use_prefix=False)
    pre, _ = engine.prefill(prompt, options=plain)
    engine.pool.free_sequence(pre.seq)
    assert pre.metrics.image_kv_hits == 0 and pre.metrics.image_kv_misses == 1
    other = replace_options(engine, use_prefix=False,
                            compression=type(engine.compression).for_model(engine.runner.num_layers, keep=0.5))
    pre, _ = engine.prefill(prompt, options=other)
    engine.pool.free_sequence(pre.seq)
    assert pre.metrics.image_kv_hits == 0
    assert_clean(engine)


def test_a_stage_moves_the_kv_layers_already_hold_to_their_compacted_slots(plain):
    """Reused KV after a compressed image (written before the step) follows the compaction: every
    position a layer still holds has, at its new slot, the KV it had at its old one."""
    from types import SimpleNamespace

    from samcache.cache.block_pool import slot_ids

    runner, pool = plain.runner, plain.pool
    n, layers, bs = 70, runner.num_layers, pool.block_size
    seq = pool.new_sequence()
    try:
        pool.append_slots(seq, n)
        table = pool.block_table(seq)
        compaction = Compaction(layers)
        compaction.remove(2, np.array([3, 4, 9]))  # an earlier record's compaction
        kv = torch.randn(layers, 2, n, runner.num_kv_heads, runner.head_dim)
        for layer in range(layers):  # each layer's tokens at that layer's compacted slots
            held = compaction.kept(layer, np.arange(n))
            rows = runner.flat_rows(layer, slot_ids(table, compaction.slots(layer, held), bs))
            for i, cache in enumerate((runner.k_cache, runner.v_cache)):
                cache.view(-1, runner.num_kv_heads, runner.head_dim)[torch.from_numpy(rows)] = kv[layer, i, held]
        job = SimpleNamespace(compaction=compaction, num_kv_tokens=n, block_table=table, prior=np.arange(n))
        removed = np.array([20, 21, 25, 40])
        runner._compact(job, 1, removed)
        for layer in range(layers):
            held = compaction.kept(layer, np.arange(n))
            if layer >= 1:
                assert not np.isin(removed, held).any()
            rows = torch.from_numpy(runner.flat_rows(layer, slot_ids(table, compaction.slots(layer, held), bs)))
            for i, cache in enumerate((runner.k_cache, runner.v_cache)):
                got = cache.view(-1, runner.num_kv_heads, runner.head_dim)[rows]
                torch.testing.assert_close(got, kv[layer, i, held], rtol=0, atol=0)
    finally:
        pool.free_sequence(seq)


@pytest.mark.parametrize("kw", [dict(prefix_reuse="approximate"), dict(kv_cache_bytes=2 << 20),
                                dict(host_kv_cache_bytes=8 << 20), dict(recompute_ratio=1.0)],
                         ids=["approximate-prefix", "small-pool", "host-tier", "full-recompute"])
def test_compression_with_sessions_forks_and_other_engine_options(moe, kw):
    """Held sessions, forks, fidelity forks and a small pool: turns succeed (a fidelity copy that
    does not fit is skipped, not fatal) and the pool stays consistent."""
    import warnings

    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25, **kw)
    session = engine.new_session("sys", hold_context=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a skipped fidelity measurement in the small pool
        for t in range(4):
            r = engine.chat(images=[screenshot(50 + t % 2, SIZE), screenshot(60 + t, SIZE)], prompt=f"turn {t}",
                            session=session, max_new_tokens=3, fidelity=t == 2)
            assert r.metrics.compressed_images >= 1
        fork = engine.fork_session(session)
        engine.chat(images=[screenshot(51, SIZE)], prompt="fork", session=fork, max_new_tokens=2)
    engine.abandon_session(fork)
    engine.check_invariants()


def test_recomputing_a_compressed_record_replays_its_merges(moe):
    """Full recompute of a record moved under a new context: every token of every layer is
    computed again and each stage's stored merge replayed, which is exactly a dense compressed
    prefill of the new prompt with the record's merges forced."""
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25, recompute_ratio=1.0)
    image = screenshot(81, SIZE)
    engine.chat(messages=[{"role": "system", "content": "Be brief."}, user_message([image], "first")],
                max_new_tokens=1)
    held = next(iter(engine.image_kv_store.entries.payloads()))
    assert held.packed and held.merges
    prompt = engine.build_prompt([{"role": "system", "content": "A longer, different context before it."},
                                  user_message([image], "second")])
    pre, logits = engine.prefill(prompt, options=replace_options(engine, use_prefix=False))
    engine.pool.free_sequence(pre.seq)
    span = prompt.images[0]
    assert pre.metrics.image_kv_hits == 1 and pre.metrics.recomputed_tokens == span.length
    forced = {0: {layer: (span.start + m, span.start + t, w) for layer, m, t, w in held.merges}}
    ref = reference_logits(engine, prompt, engine.compression, forced=forced)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
    # Partial recompute: the groups of the recomputed anchors are closed, the turn runs.
    partial = make_engine(moe, compression_enabled=True, compression_keep=0.25, recompute_ratio=0.2,
                          recompute_budget="uniform", share_weights_with=engine)
    partial.chat(messages=[{"role": "system", "content": "Be brief."}, user_message([image], "first")],
                 max_new_tokens=1)
    r = partial.chat(messages=[{"role": "system", "content": "A longer, different context before it."},
                               user_message([image], "second")], max_new_tokens=2, fidelity=True)
    assert r.metrics.image_kv_hits == 1 and 0 < r.metrics.recomputed_tokens < span.length
    assert np.isfinite(r.metrics.fidelity.kl)
    assert_clean(partial)


def test_routing_relevance_ranks_track_two_by_the_records_confidence(moe):
    """With recompute_relevance="routing", track 2 takes a record's most confident tokens (at its
    first stage) instead of the most attended ones; a plain engine refuses the option."""
    engine = make_engine(moe, compression_enabled=True, compression_keep=0.25, recompute_ratio=0.2,
                         recompute_relevance="routing")
    image = screenshot(91, SIZE)
    engine.chat(messages=[{"role": "system", "content": "Be brief."}, user_message([image], "first")], max_new_tokens=1)
    held = next(iter(engine.image_kv_store.entries.payloads()))
    prompt = engine.build_prompt([{"role": "system", "content": "Another context."}, user_message([image], "again")])
    layout = engine.executor.layout(prompt, Namespace(engine.model_id))
    packed = [SimpleNamespace(image=0, start=prompt.images[0].start)]
    scores = engine.executor.compressed.routing_relevance(prompt, packed, {layout.images[0].key: held}, layout)
    _, members, _, weights = held.merges[0]
    assert np.array_equal(scores[prompt.images[0].start + members], weights)
    assert scores[: prompt.images[0].start].sum() == 0
    r = engine.chat(messages=[{"role": "system", "content": "Another context."}, user_message([image], "again")],
                    max_new_tokens=2, fidelity=True)
    assert r.metrics.image_kv_hits == 1 and r.metrics.recomputed_tokens > 0
    with pytest.raises(ValueError, match="needs compression_enabled"):
        make_engine(moe, recompute_relevance="routing")
    with pytest.raises(ValueError, match="recompute_relevance"):
        make_engine(moe, recompute_relevance="votes")
