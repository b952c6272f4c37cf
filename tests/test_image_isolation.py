"""Image-isolated attention: the property (samcache.profile.image_attention), its Hugging Face
reference with explicit per-layer 4-D masks (samcache.tasks.image_isolation), and the engine serving
it exactly: every image computed alone and spliced, first sight included, reused at any index."""

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from samcache import Namespace  # noqa: E402
from samcache.engine import SAMcacheEngine, screenshot  # noqa: E402
from samcache.engine.fidelity import reference_prefill  # noqa: E402
from samcache.engine.loading import load_processor  # noqa: E402
from samcache.engine.prompt import build_prompt, user_message  # noqa: E402
from samcache.profile.image_attention import CONFIG_KEY, ImageAttention, declare, declared  # noqa: E402
from samcache.random_checkpoints import build_tiny_model, model_class  # noqa: E402
from samcache.tasks.image_isolation import (enable_vision_ids, forward_logits, isolate_batch,  # noqa: E402
                                            vision_ids_enabled)
from samcache.tasks.training import _chat  # noqa: E402

from engine_helpers import SIZE, assert_clean  # noqa: E402


@pytest.fixture(scope="module")
def isolated_checkpoint(tiny_checkpoints, tmp_path_factory):
    """The tiny random Qwen2.5-VL, declared isolated (with a sink), vision ids on."""
    out = tmp_path_factory.mktemp("isolated")
    shutil.copytree(tiny_checkpoints["qwen2_5_vl"], out, dirs_exist_ok=True)
    declare(out, ImageAttention("isolated"))
    enable_vision_ids(out)
    return out


@pytest.fixture(scope="module")
def hf_model(isolated_checkpoint):
    model = model_class("qwen2_5_vl").from_pretrained(isolated_checkpoint, dtype=torch.float32).eval()
    return model, load_processor(isolated_checkpoint)


def conversation(system, images, question="What is shown?"):
    return [{"role": "system", "content": system}, user_message(images, question)]


def hf_batch(processor, conversations):
    texts, images = [], []
    for msgs in conversations:
        chat, ims = _chat(msgs)
        texts.append(processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        images.extend(Image.fromarray(np.asarray(im)) for im in ims)
    return dict(processor(text=texts, images=images, padding=True, padding_side="right", return_tensors="pt"))


# ---- the property --------------------------------------------------------------------------------
def test_names_round_trip_and_bad_settings_are_refused():
    for name in ("causal", "isolated", "isolated-nosink", "isolated-top2", "isolated-nosink-top1"):
        assert ImageAttention.parse(name).name == name
    with pytest.raises(ValueError, match="unknown image attention 'sideways'"):
        ImageAttention.parse("sideways")
    with pytest.raises(ValueError, match="'top' is not"):
        ImageAttention.parse("isolated-top")
    with pytest.raises(ValueError, match="unknown image attention"):
        ImageAttention("isolating")
    with pytest.raises(ValueError, match="causal takes none"):
        ImageAttention("causal", context_layers=1)
    with pytest.raises(ValueError, match="at least one layer must be isolated"):
        ImageAttention("isolated", context_layers=4).check_depth(4)
    with pytest.raises(ValueError, match=r"config\.json.*unknown field"):
        ImageAttention.from_dict({"mode": "isolated", "extra": 1}, "x/config.json")


def test_a_checkpoint_declares_its_attention(tiny_checkpoints, isolated_checkpoint, tmp_path):
    assert declared(tiny_checkpoints["qwen2_5_vl"]) == ImageAttention()
    assert declared(isolated_checkpoint) == ImageAttention("isolated")
    bad = tmp_path / "bad"
    shutil.copytree(isolated_checkpoint, bad)
    text = (bad / "config.json").read_text().replace('"mode": "isolated"', '"mode": "sideways"')
    (bad / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"{CONFIG_KEY}.*unknown image attention 'sideways'"):
        declared(bad)
    assert vision_ids_enabled(isolated_checkpoint) and not vision_ids_enabled(tiny_checkpoints["qwen2_5_vl"])


# ---- the Hugging Face reference ------------------------------------------------------------------
def test_causal_reference_is_the_models_own_forward(hf_model):
    model, processor = hf_model
    batch = hf_batch(processor, [conversation("Short.", [screenshot(1, SIZE)]),
                                 conversation("A longer system prompt.", [screenshot(2, SIZE), screenshot(3, SIZE)])])
    with torch.no_grad():
        own = model(**batch).logits
        ref, _ = forward_logits(model, batch, ImageAttention())
    assert torch.equal(own, ref)


def test_isolated_image_rows_do_not_depend_on_their_context(hf_model):
    """An image's rows at every layer see only its sink, its frame and itself at canonical
    distances: the same image after other text, at another index, gives the same outputs."""
    model, processor = hf_model
    a, b, c = screenshot(4, SIZE), screenshot(5, SIZE), screenshot(6, SIZE)
    batch = hf_batch(processor, [conversation("Short.", [a, b]), conversation("A much longer system prompt.", [c, b, a])])
    with torch.no_grad():
        iso_logits, iso = forward_logits(model, batch, ImageAttention("isolated"))
        causal_logits, _ = forward_logits(model, batch, ImageAttention())
    image = model.config.image_token_id
    rows = [iso_logits[i][iso["input_ids"][i] == image] for i in range(2)]
    n = rows[0].shape[0] // 2
    torch.testing.assert_close(rows[0][:n], rows[1][2 * n:], rtol=0, atol=1e-5)  # a: first, then third
    torch.testing.assert_close(rows[0][n:], rows[1][n:2 * n], rtol=0, atol=1e-5)  # b: second, still second
    original = batch["input_ids"] == image
    moved = causal_logits[0][original[0]][:n] - causal_logits[1][original[1]][2 * n:]
    assert moved.abs().max() > 1e-3  # the causal model's rows do depend on the context


def test_isolated_batch_layout(hf_model):
    """Copies of the segment prefix before each frame token, at the canonical distance, unlabelled;
    text never attends to them, images attend to nothing else outside their own image."""
    model, processor = hf_model
    batch = hf_batch(processor, [conversation("Sys.", [screenshot(7, SIZE), screenshot(8, SIZE)])])
    batch["labels"] = batch["input_ids"].clone()
    batch["loss_weights"] = torch.ones(batch["input_ids"].shape)
    iso = isolate_batch(model, batch, ImageAttention("isolated"))
    cfg = model.config
    ids, pos = iso["input_ids"][0], iso["position_ids"][:, 0]
    assert ids.numel() == batch["input_ids"].numel() + 4
    frames = (ids == cfg.vision_start_token_id).nonzero().flatten().tolist()
    assert len(frames) == 4  # two copies and two frame tokens
    for copy_frame in frames[0::2]:
        sink, frame, real = copy_frame - 1, copy_frame, copy_frame + 1
        assert ids[sink] == ids[0] and ids[real] == cfg.vision_start_token_id
        first_image = real + 1
        assert ids[first_image] == cfg.image_token_id
        assert pos[:, sink].tolist() == [pos[0, first_image].item() - 2] * 3
        assert pos[:, frame].tolist() == [pos[0, first_image].item() - 1] * 3
        assert iso["labels"][0, sink] == -100 and iso["loss_weights"][0, frame] == 0
    allowed = iso["layer_masks"][0][0, 0] == 0
    image_rows = (ids == cfg.image_token_id).nonzero().flatten()
    text_rows = torch.tensor([i for i in range(ids.numel()) if ids[i] != cfg.image_token_id
                              and i not in (frames[0] - 1, frames[0], frames[2] - 1, frames[2])])
    copies = torch.tensor([frames[0] - 1, frames[0], frames[2] - 1, frames[2]])
    assert not allowed[text_rows][:, copies].any()
    first = image_rows[: image_rows.numel() // 2]
    assert allowed[first[-1]].nonzero().flatten().tolist() == [frames[0] - 1, frames[0], *first.tolist()]
    causal = ImageAttention("isolated", context_layers=1)
    masks = isolate_batch(model, batch, causal)["layer_masks"]
    assert masks[0] is masks[-2] and masks[-1] is not masks[0]
    top = masks[-1][0, 0] == 0
    assert not top[first[-1]][copies].any() and top[first[-1]][: frames[0] - 1].all()


# ---- the engine serves it exactly -----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(isolated_checkpoint):
    return SAMcacheEngine(isolated_checkpoint, device="cpu", kv_cache_bytes=16 << 20)


def test_engine_reads_the_declaration(engine, tiny_checkpoints):
    assert engine.image_attention == ImageAttention("isolated")
    assert not engine.keeps_image_order()  # exact at any index: "auto" reuses everywhere
    assert engine.request_options().budget is None  # nothing to repair
    causal = SAMcacheEngine(tiny_checkpoints["qwen2_5_vl"], device="cpu", kv_cache_bytes=4 << 20,
                            image_attention="isolated")
    assert causal.image_attention.isolated and "image-attention=isolated" in causal.model_id
    with pytest.raises(ValueError, match="not its input to the layers in context"):
        SAMcacheEngine(tiny_checkpoints["qwen2_5_vl"], device="cpu", kv_cache_bytes=4 << 20,
                       image_attention="isolated-top1", host_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="M-RoPE"):
        SAMcacheEngine(tiny_checkpoints["internvl"], device="cpu", kv_cache_bytes=4 << 20, image_attention="isolated")


def test_engine_equals_the_masked_reference_on_first_sight_and_after_moves(engine, hf_model):
    """First-seen images (computed alone), known ones at new indices and after other text (spliced
    from the store): the engine's logits equal the Hugging Face forward with explicit masks."""
    model, processor = hf_model
    a, b, c = screenshot(11, SIZE), screenshot(12, SIZE), screenshot(13, SIZE)
    turns = [conversation("Short.", [a, b]), conversation("A much longer system prompt here.", [c, b, a]),
             conversation("Short.", [b, c])]
    expected_hits = [0, 2, 2]
    for msgs, hits in zip(turns, expected_hits):
        prompt = engine.build_prompt(msgs)
        pre, logits = engine.prefill(prompt)
        engine.pool.free_sequence(pre.seq)
        with torch.no_grad():
            ref, _ = forward_logits(model, hf_batch(processor, [msgs]), ImageAttention("isolated"))
        torch.testing.assert_close(logits.float(), ref[0, -1], rtol=0, atol=2e-5)
        m = pre.metrics
        assert m.image_kv_hits == hits and m.image_kv_misses == len(prompt.images) - hits
        assert m.isolated_tokens == (len(prompt.images) - hits) * (2 + prompt.images[0].length)
        assert m.recomputed_tokens == 0 and m.exact_tokens == len(prompt)  # exact: hashed into the prefix cache
    assert_clean(engine)


def test_reuse_at_a_new_index_is_exact_against_the_full_prefill(engine):
    a, b = screenshot(21, SIZE), screenshot(22, SIZE)
    engine.chat(messages=conversation("First.", [a, b]), max_new_tokens=2)
    prompt = engine.build_prompt(conversation("Another agent, another system prompt.", [b, a]))
    pre, logits = engine.prefill(prompt)
    engine.pool.free_sequence(pre.seq)
    assert pre.metrics.image_reused_tokens == sum(s.length for s in prompt.images) and pre.metrics.isolated_tokens == 0
    ref, full = reference_prefill(engine.executor, prompt, engine.model_id, Namespace(engine.model_id))
    engine.pool.free_sequence(ref.seq)
    assert ref.metrics.isolated_tokens > 0  # the full prefill computes every image alone too
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)
    # and whole replies: greedy tokens with reuse equal those of an engine without any cache
    plain = SAMcacheEngine(engine.model_path, device="cpu", kv_cache_bytes=16 << 20, cache_enabled=False,
                           share_weights_with=engine)
    msgs = conversation("A third prompt.", [a, screenshot(23, SIZE), b])
    got = engine.chat(messages=msgs, max_new_tokens=8, ignore_eos=True)
    want = plain.chat(messages=msgs, max_new_tokens=8, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.metrics.image_reused_tokens > 0
    assert_clean(engine)


def test_a_record_computed_after_another_sink_is_not_reused(engine):
    """The sink is part of an isolated image's KV: a prompt that starts with another token misses."""
    image = screenshot(31, SIZE)
    engine.chat(messages=conversation("Sink test.", [image]), max_new_tokens=1)
    prompt = engine.build_prompt(conversation("Sink test.", [image]))
    other = build_prompt([5, *prompt.token_ids[1:prompt.images[0].start].tolist(), engine.image_token_id,
                          *prompt.token_ids[prompt.images[0].end:].tolist()],
                         [prompt.images[0].image], image_token_id=engine.image_token_id,
                         merge_size=engine.geometry.merge_size)
    pre, _ = engine.prefill(other, options=engine.request_options())
    engine.pool.free_sequence(pre.seq)
    assert pre.metrics.image_kv_hits == 0 and pre.metrics.image_kv_misses == 1 and pre.metrics.isolated_tokens > 0
    assert_clean(engine)


def test_link_tokens_are_text_in_context(isolated_checkpoint, tmp_path):
    """Link tokens after each image (the chat template's): computed in context like any text, and
    the engine still equals the masked reference; a template with none, or twice, is refused."""
    from samcache.tasks.image_isolation import LINK_TOKEN, enable_link_tokens, link_tokens

    folder = tmp_path / "linked"
    shutil.copytree(isolated_checkpoint, folder)
    enable_link_tokens(folder, 2)
    assert link_tokens(folder) == 2 and link_tokens(isolated_checkpoint) == 0
    with pytest.raises(ValueError, match="already writes link tokens"):
        enable_link_tokens(folder, 2)
    with pytest.raises(ValueError, match="link tokens must be an int >= 1"):
        enable_link_tokens(isolated_checkpoint, 0)
    engine = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=16 << 20)
    model = model_class("qwen2_5_vl").from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(folder)
    link = processor.tokenizer.convert_tokens_to_ids(LINK_TOKEN)
    a, b = screenshot(51, SIZE), screenshot(52, SIZE)
    for msgs in (conversation("One.", [a, b]), conversation("Two, longer.", [b, a])):
        prompt = engine.build_prompt(msgs)
        assert int((prompt.token_ids == link).sum()) == 4
        pre, logits = engine.prefill(prompt)
        engine.pool.free_sequence(pre.seq)
        with torch.no_grad():
            ref, _ = forward_logits(model, hf_batch(processor, [msgs]), ImageAttention("isolated"))
        torch.testing.assert_close(logits.float(), ref[0, -1], rtol=0, atol=2e-5)
    assert pre.metrics.image_kv_hits == 2


def test_top_layers_in_context_are_served_exactly(tmp_path):
    """isolated-top2 on a 3-layer model: images isolated in layer 0, in context in layers 1-2. The
    engine splices the lower layer's KV and computes the image rows of the top layers from their
    kept input, first sight included: its logits equal the masked reference's, the image reused.
    (isolated-top1 changes no output: the first layer in context computes the image's KV from
    context-free inputs, and its outputs feed no layer.)"""
    folder = build_tiny_model("qwen2_5_vl", tmp_path / "deep", num_hidden_layers=3)
    declare(folder, ImageAttention("isolated"))
    enable_vision_ids(folder)
    model = model_class("qwen2_5_vl").from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(folder)
    attention = ImageAttention("isolated", context_layers=2)
    engine = SAMcacheEngine(folder, device="cpu", kv_cache_bytes=16 << 20, image_attention=attention)
    a, b, c = screenshot(61, SIZE), screenshot(62, SIZE), screenshot(63, SIZE)
    for msgs, hits in ((conversation("Short.", [a, b]), 0), (conversation("A longer system prompt.", [c, b, a]), 2)):
        prompt = engine.build_prompt(msgs)
        pre, logits = engine.prefill(prompt)
        engine.pool.free_sequence(pre.seq)
        batch = hf_batch(processor, [msgs])
        with torch.no_grad():
            ref, _ = forward_logits(model, batch, attention)
            full, _ = forward_logits(model, batch, ImageAttention("isolated"))
            top1, _ = forward_logits(model, batch, ImageAttention("isolated", context_layers=1))
        torch.testing.assert_close(logits.float(), ref[0, -1], rtol=0, atol=2e-5)
        assert (logits.float() - full[0, -1]).abs().max() > 1e-4  # the layers in context do matter
        torch.testing.assert_close(top1[0, -1], full[0, -1], rtol=0, atol=1e-5)
        image_tokens = sum(s.length for s in prompt.images)
        assert pre.metrics.image_kv_hits == hits and pre.metrics.recomputed_token_layers == 2 * image_tokens
        assert pre.metrics.exact_tokens == len(prompt)
    assert_clean(engine)
