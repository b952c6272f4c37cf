"""An isolated model's first-seen images inside an engine plugin's step
(samcache.integrations.isolated_rows, StepPlan's isolated path), on hand-made inputs: the side rows'
layout, their attention against a float64 reference, and the plan: first-seen images go to side
rows (their own rows skipped, saved with the variant and sink in their record), stored ones are
spliced as exact, and an image that cannot be computed alone falls back, counted and approximate.
The end-to-end tests through the real engines are in tests/vllm_plugin/ and tests/sglang_plugin/."""

import numpy as np
import pytest
import torch

from samcache.cache.stores import TensorStore
from samcache.hashing import Namespace
from samcache.integrations.forward_plan import ImageKV, PendingSave, Rotary
from samcache.integrations.isolated_rows import IsolatedServing, SideRowsBuilder
from samcache.integrations.vllm.identity import content_identifier, store_key
from samcache.integrations.vllm.step import ImageRef, RequestStep, plan_forward
from samcache.profile.image_attention import ImageAttention

from plugin_helpers import Metadata  # noqa: E402

H, D, L, BS = 2, 8, 3, 4
ROTARY = Rotary((1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))).float(), "mrope", (2, 1, 1))
MODEL = "vllm|tiny|float32"
FRAME, SINK = 151652, 151644
SERVING = IsolatedServing(ImageAttention("isolated"), FRAME)


def image_positions(start: int, grid=(2, 3)) -> torch.Tensor:
    h, w = grid
    return torch.stack([torch.full((h * w,), start), torch.arange(h).repeat_interleave(w) + start,
                        torch.arange(w).repeat(h) + start])


def test_side_sequences_sit_right_before_their_image_and_see_only_themselves():
    b = SideRowsBuilder()
    at_a = b.add([SINK, FRAME], torch.arange(10, 16), image_positions(30))
    at_b = b.add([FRAME], torch.tensor([3, 4]), image_positions(7, (1, 2)))
    side = b.build(torch.int64)
    assert (at_a, at_b, side.size, b.sequences) == (2, 9, 11, 2)
    assert side.tokens.tolist() == [SINK, FRAME, FRAME] and side.token_at.tolist() == [0, 1, 8]
    assert side.image_rows.tolist() == [10, 11, 12, 13, 14, 15, 3, 4]
    assert side.image_at.tolist() == [2, 3, 4, 5, 6, 7, 9, 10]
    # the prefix at the positions before the image on every axis: the canonical side sequence, moved
    assert side.positions[:, :2].tolist() == [[28, 29]] * 3 and side.positions[:, 8].tolist() == [6, 6, 6]
    assert torch.equal(side.positions[:, 2:8], image_positions(30))
    want = torch.zeros(11, 11, dtype=torch.bool)
    want[:8, :8] = torch.ones(8, 8, dtype=torch.bool).tril()
    want[8:, 8:] = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(side.mask, want)


@pytest.mark.parametrize("seed, heads, kv_heads, lengths", [(0, 4, 2, (5, 9)), (1, 2, 2, (3,)), (2, 6, 1, (4, 2, 7))])
def test_side_attention_equals_a_float64_reference_per_sequence(seed, heads, kv_heads, lengths):
    g = torch.Generator().manual_seed(seed)
    b = SideRowsBuilder()
    for n in lengths:
        b.add([SINK, FRAME], torch.arange(n), image_positions(5, (1, n)))
    side = b.build(torch.int64)
    q = torch.randn(side.size, heads, D, generator=g)
    k, v = torch.randn(side.size, kv_heads, D, generator=g), torch.randn(side.size, kv_heads, D, generator=g)
    out = side.attention(q, k, v, scale=D ** -0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
    at = 0
    for n in (2 + n for n in lengths):  # each sequence alone, causal, in float64
        qs, ks, vs = (t[at:at + n].double() for t in (q, k, v))
        ks, vs = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * D ** -0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        torch.testing.assert_close(out[at:at + n].double(), want, atol=1e-5, rtol=0)
        at += n


def test_side_rows_take_the_images_embeddings_and_the_prefix_tokens_embeddings():
    b = SideRowsBuilder()
    b.add([5, 6], torch.tensor([1, 2]), image_positions(3, (1, 2)))
    side = b.build(torch.int64)
    inputs = torch.randn(4, 3)
    table = torch.nn.Embedding(10, 3)
    out = side.embeddings(inputs, table)
    torch.testing.assert_close(out, torch.cat([table(torch.tensor([5, 6])), inputs[1:3]]).detach())


def test_a_side_save_captures_its_rows_after_the_layers_own():
    save = PendingSave(("k",), torch.tensor([7, 8, 9]), image_positions(7, (1, 3)), side_at=4, record=("x",))
    keys = torch.arange(20.0)[:, None, None].expand(20, 1, 2)
    save.capture(torch.arange(10), keys, keys)  # 10 rows of the step, then the side rows
    assert save.k[0][:, 0, 0].tolist() == [14.0, 15.0, 16.0] and save.check == (3, "x")


class Writer:
    block_size = BS

    def __init__(self):
        self.slots = set()

    def write(self, layer, keys, values, slots):
        self.slots.update(slots.tolist())


def plan(store, *, start=0, sink=SINK, images=((5, 6), (13, 2))):
    """One request: 18 prompt tokens [start, 18) scheduled, images ``(offset, length)`` after their
    frame tokens; contents "img0", "img1", ...; blocks 0..4."""
    n = 18 - start
    md = Metadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([18], dtype=torch.int32),
                  slot_mapping=torch.arange(start, 18, dtype=torch.int64),
                  block_table=torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32))
    positions = torch.arange(start, 18).repeat(3, 1)
    for offset, length in images:
        if offset >= start:
            positions[:, offset - start: offset - start + length] = image_positions(offset, (1, length))
    refs = tuple(ImageRef(content_identifier(f"img{i}"), o, n_) for i, (o, n_) in enumerate(images))
    step = RequestStep("r", start, n, (0, 1, 2, 3, 4), refs, "t", sink_token=sink)
    writer = Writer()
    fs = plan_forward([step], attn_metadata=md, positions=positions, cache=writer, rotary=ROTARY, store=store,
                      model_id=MODEL, budget=None, num_layers=L, isolated=SERVING)
    return fs, writer


def test_first_seen_images_go_to_side_rows_and_stored_ones_are_spliced_exactly():
    store = TensorStore("s", 1 << 20)
    ns = Namespace(MODEL, "t")
    record = SERVING.check(SINK)
    store.put(store_key(content_identifier("img1"), ns), ImageKV(torch.randn(L, 2, H, D), torch.randn(L, 2, H, D),
                                                                  image_positions(40, (1, 2)), 0), check=(2, *record))
    fs, writer = plan(store)
    assert fs.side is not None and fs.side.size == 2 + 6 and fs.side.image_rows.tolist() == list(range(5, 11))
    assert torch.equal(fs.side_slots, torch.arange(5, 11))  # the image's own slots
    assert writer.slots == {13, 14}  # the stored image, spliced where it now is
    assert not fs.approximate  # exact: an isolated record is what a full prefill computes anywhere
    assert fs.rows[0].tolist() == [*range(0, 5), 11, 12, *range(15, 18)]  # both images' rows skipped
    assert fs.stats["isolated_images"] == 1 and fs.stats["image_kv_hits"] == 1 and fs.stats["recomputed_tokens"] == 0
    (save,) = fs.saves
    assert save.side_at == 2 and save.check == (6, *record)
    # another first token: the record does not match, both images are computed alone
    fs, _ = plan(store, sink=7)
    assert fs.stats["image_kv_hits"] == 0 and fs.stats["isolated_images"] == 2 and fs.side.size == (2 + 6) + (2 + 2)


def test_an_image_that_cannot_be_computed_alone_falls_back_and_is_marked_approximate():
    store = TensorStore("s", 1 << 20)
    fs, _ = plan(store, start=8)  # image 0's first tokens came from the prefix cache; the store lost it
    assert fs.stats["isolated_fallbacks"] == 1 and fs.stats["isolated_images"] == 1 and fs.approximate == {"r": 5}
    fs, _ = plan(store, sink=None)  # the prompt's first token is not known
    assert fs.stats["isolated_fallbacks"] == 2 and fs.side is None and fs.approximate == {"r": 5} and not fs.saves


def test_the_top_layers_variant_is_not_served_by_the_plugins():
    with pytest.raises(ValueError, match="keeps its top 1 layers in context"):
        IsolatedServing(ImageAttention("isolated", context_layers=1), FRAME)
    with pytest.raises(ValueError, match="is for isolated image attention"):
        IsolatedServing(ImageAttention(), FRAME)
    with pytest.raises(ValueError, match="needs its prompt's first token"):
        SERVING.prefix(None)
    assert np.array_equal(SERVING.prefix(3), [3, FRAME])


def test_a_same_step_prefix_hit_takes_the_rest_of_the_image_from_the_other_requests_side_rows():
    """Two requests in one step, the second's prefix hit (8 tokens) covering the first 3 tokens of
    an image the first computes alone: the second's 3 remaining image rows are skipped and written
    from the first's side rows; at other positions they would fall back."""
    from samcache.integrations.forward_plan import RequestImage, StepPlan
    from samcache.integrations.vllm.identity import content_of

    def run(shift):
        plan = StepPlan(18 + 10, L)
        ns, image = Namespace(MODEL, "t"), content_of(content_identifier("img0"))
        pos_a = torch.arange(0, 18).repeat(3, 1)
        pos_a[:, 5:11] = image_positions(5, (1, 6))
        pos_b = pos_a[:, 8:].clone() + shift  # the second request: tokens [8, 18) scheduled
        positions = torch.cat([pos_a, pos_b], dim=1)
        slots = torch.arange(28)
        store = TensorStore("s", 1 << 20)
        for owner, begin, base in (("a", 0, 0), ("b", 8, 18)):
            plan.add_request([RequestImage(image, 5, 6)], begin=begin, end=18, base=base, namespace=ns, store=store, budget=None,
                             keep_image_order=False, positions=positions, slots=slots, cache=Writer(), rotary=ROTARY,
                             owner=owner, isolated=SERVING, sink_token=SINK)
        plan.settle()
        return plan

    plan = run(0)
    side = plan.side.build(torch.int64)
    assert plan.counters.isolated_images == 1 and plan.counters.isolated_fallbacks == 0 and not plan.approximate
    assert side.write_rows.tolist() == [5, 6, 7, 8, 9, 10, 18, 19, 20]  # the second's rows 8..10 of the prompt
    assert side.write_at.tolist() == [2, 3, 4, 5, 6, 7, 5, 6, 7]
    assert plan.skipped[18:21].all() and not plan.skipped[21:].any()
    moved = run(1)  # the same image at other positions: not the blocks the hit was on
    assert moved.counters.isolated_fallbacks == 1 and moved.approximate == {"b": 5}


def test_bad_side_rows_are_refused():
    b = SideRowsBuilder()
    with pytest.raises(ValueError, match="no side sequence was added"):
        b.build(torch.int64)
    with pytest.raises(ValueError, match=r"image_positions must be \[3, 2\]"):
        b.add([SINK, FRAME], torch.tensor([1, 2]), image_positions(3, (1, 3)))
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        b.add([SINK, FRAME], torch.tensor([], dtype=torch.int64), torch.zeros(3, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="starts with its segment prefix"):
        b.add([], torch.tensor([1]), image_positions(3, (1, 1)))
    b.add([FRAME], torch.tensor([1, 2]), image_positions(3, (1, 2)))
    with pytest.raises(ValueError, match="are not among the 3 added"):
        b.also_write(2, torch.tensor([7, 8]))
    with pytest.raises(ValueError, match="frame_token must be a token id"):
        IsolatedServing(ImageAttention("isolated"), -1)
    with pytest.raises(TypeError, match="must be an ImageAttention"):
        IsolatedServing("isolated", FRAME)
