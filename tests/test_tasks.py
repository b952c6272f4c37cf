"""The visual QA task family: deterministic per seed, answers derivable from the images (checked by an
independent solver that reads only the question text and the specs), pixels that show what the
specs say, traces whose images move between turns, and clear errors."""

import itertools
import re

import numpy as np
import pytest
from samcache.tasks import visual_qa as vqa

ORD = {o: i for i, o in enumerate(vqa.ORDINALS)}


def solve(specs, question):
    """The answer to ``question`` over ``specs`` (in prompt order), asserting it is unique."""
    q = re.sub(r"^Step \d+\. ", "", question)

    def image(ordinal):
        return specs[ORD[ordinal]] if ordinal else specs[0] if len(specs) == 1 else pytest.fail(f"no ordinal: {q}")

    if m := re.fullmatch(r"What colour is the (\w+) in the (.+?)(?: of the (\w+) \w+)?\?", q):
        found = [e for e in image(m[3]).elements if e.kind == m[1] and e.cell == m[2]]
        assert len(found) == 1, q
        return found[0].colour
    if m := re.fullmatch(r"Where is the (\w+) (\w+)(?: in the (\w+) \w+)?\?", q):
        found = image(m[3]).find(label=m[1], kind=m[2])
        assert len(found) == 1, q
        return found[0].cell
    if m := re.fullmatch(r"What is the label of the (\w+) (\w+)(?: in the (\w+) \w+)?\?", q):
        found = image(m[3]).find(colour=m[1], kind=m[2])
        assert len(found) == 1, q
        return found[0].label
    if m := re.fullmatch(r"Which \w+ shows the (\w+) (\w+)\?", q):
        hits = [i for i, s in enumerate(specs) if s.find(label=m[1], kind=m[2])]
        assert len(hits) == 1 and sum(bool(s.find(label=m[1])) for s in specs) == 1, q  # X in exactly one image
        return vqa.ORDINALS[hits[0]]
    if q == "What is the title of this page?":
        assert len(specs) == 1 and specs[0].kind == "docs"
        return specs[0].title
    if m := re.fullmatch(r"What is the title of the (\w+) \w+\?", q):
        assert image(m[1]).kind == "docs"
        return image(m[1]).title
    if m := re.fullmatch(r"What is the first word of the (\w+) line(?: of the (\w+) \w+)?\?", q):
        return image(m[2]).lines[ORD[m[1]]][0]
    if q == "What is the title of the page shown before this one?":
        assert specs[-1].kind == "docs" and specs[-2].kind == "docs"
        return specs[-2].title
    if m := re.fullmatch(r"Which \w+ has the title (\w+)\?", q):
        hits = [i for i, s in enumerate(specs) if s.kind == "docs" and s.title == m[1]]
        assert len(hits) == 1, q
        return vqa.ORDINALS[hits[0]]
    pytest.fail(f"unparsed question {q!r}")


def check_specs(specs):
    for s in specs:
        if s.kind == "gui":
            assert 1 <= len(s.elements) <= vqa.MAX_ELEMENTS
            for attr in ("cell", "colour", "label"):
                values = [getattr(e, attr) for e in s.elements]
                assert len(set(values)) == len(values), (attr, s)
        else:
            assert s.title in vqa.TITLES and 2 <= len(s.lines) <= 4


@pytest.mark.parametrize("kind", vqa.IMAGE_KINDS)
@pytest.mark.parametrize("num_images", [1, 2, 3, 4])
def test_answers_are_in_their_choices_and_derivable_from_the_specs(kind, num_images):
    seen = set()
    for seed in range(40):
        ex = vqa.make_example(seed, num_images=num_images, kind=kind)
        seen.add(ex.question_type)
        check_specs(ex.specs)
        assert len(ex.images) == len(ex.specs) == num_images
        assert ex.answer in ex.choices
        assert ex.choices == vqa.ANSWER_SETS[vqa.QUESTIONS[ex.question_type].answers][:num_images] \
            or vqa.QUESTIONS[ex.question_type].answers != "ordinal"
        assert solve(ex.specs, ex.question) == ex.answer
        assert ex.specs[ex.target_image].kind == vqa.QUESTIONS[ex.question_type].image_kind
        if kind == "mixed" and num_images > 1:
            assert " image" in ex.question or "page shown before" in ex.question
    names = {q for q in vqa.QUESTIONS if vqa.QUESTIONS[q].min_images <= num_images
             and (kind == "mixed" or vqa.QUESTIONS[q].image_kind == kind)}
    assert seen == names  # every applicable question type comes up


@pytest.mark.parametrize("question", list(vqa.QUESTIONS))
def test_each_question_type_on_request(question):
    q = vqa.QUESTIONS[question]
    for n in range(q.min_images, 5):
        for seed in range(10):
            ex = vqa.make_example(seed, num_images=n, kind=q.image_kind, question=question)
            assert ex.question_type == question and ex.answer in ex.choices
            assert solve(ex.specs, ex.question) == ex.answer


def test_multi_image_questions_need_the_named_image():
    """With distractors planted, asking the same question of another image often gives another
    answer or none: the ordinal matters."""
    differs = total = 0
    for seed in range(60):
        ex = vqa.make_example(seed, num_images=4, kind="gui", question=["colour", "where", "label"][seed % 3])
        for i in range(4):
            if i == ex.target_image:
                continue
            other = ex.question.replace(f"the {vqa.ORDINALS[ex.target_image]} screenshot", f"the {vqa.ORDINALS[i]} screenshot")
            total += 1
            try:
                differs += solve(ex.specs, other) != ex.answer
            except AssertionError:
                differs += 1  # no such element there
    assert differs / total > 0.9


def test_same_seed_same_bytes_and_text_different_seeds_differ():
    a = vqa.make_example(7, num_images=3, kind="mixed")
    vqa.render.cache_clear()  # draw again from scratch
    b = vqa.make_example(7, num_images=3, kind="mixed")
    assert (a.question, a.answer, a.specs, a.choices) == (b.question, b.answer, b.specs, b.choices)
    assert all(x.tobytes() == y.tobytes() and x.dtype == np.uint8 for x, y in zip(a.images, b.images))
    assert vqa.describe(a.specs[0]) == vqa.describe(b.specs[0])
    others = [vqa.make_example(s, num_images=3, kind="mixed") for s in range(8, 14)]
    assert all(o.specs != a.specs for o in others)
    assert all(not np.array_equal(o.images[0], a.images[0]) for o in others)
    t1, t2 = vqa.trace(3, scenario="subagent"), vqa.trace(3, scenario="subagent")
    assert [t.question for t in t1] == [t.question for t in t2]
    assert all(x.tobytes() == y.tobytes() for u, v in zip(t1, t2) for x, y in zip(u.images(), v.images()))
    assert [t.question for t in vqa.trace(4, scenario="subagent")] != [t.question for t in t1]


def test_train_and_test_streams_are_disjoint():
    train = {vqa.split_seed("train", i, s) for s in range(4) for i in range(500)}
    test = {vqa.split_seed("test", i, s) for s in range(4) for i in range(500)}
    assert len(train) == len(test) == 2000 and not train & test
    tr = list(vqa.examples("train", 5, num_images=2, seed=1))
    te = list(vqa.examples("test", 5, num_images=2, seed=1))
    assert [e.seed for e in tr] == [vqa.split_seed("train", i, 1) for i in range(5)]
    assert not {e.seed for e in tr} & {e.seed for e in te}
    assert [e.question for e in vqa.examples("test", 5, num_images=2, seed=1)] == [e.question for e in te]
    assert all(len(e.images) == 2 for e in tr)


@pytest.mark.parametrize("size", [(112, 112), (224, 224), (84, 140)])
def test_pixels_in_a_cell_show_the_elements_colour(size):
    palette = {name: np.array(rgb, dtype=np.uint8) for name, rgb in vqa.COLOURS.items()}
    for seed in range(30):
        ex = vqa.make_example(seed, kind="gui", size=size)
        img = ex.images[0]
        assert img.shape == (*size, 3) and img.dtype == np.uint8 and not img.flags.writeable
        for e in ex.specs[0].elements:
            x0, y0, x1, y1 = vqa.cell_box(size, e.cell)
            cell = img[y0:y1, x0:x1]
            counts = {n: int(np.all(cell == rgb, axis=-1).sum()) for n, rgb in palette.items()}
            assert max(counts, key=counts.get) == e.colour, (e, counts)
            assert counts[e.colour] >= 0.08 * cell.shape[0] * cell.shape[1]
        empty = set(vqa.CELLS) - {e.cell for e in ex.specs[0].elements}
        for c in empty:  # nothing drawn in empty cells
            x0, y0, x1, y1 = vqa.cell_box(size, c)
            assert np.all(img[y0:y1, x0:x1] == vqa.GUI_BACKGROUND)


def test_labels_and_titles_are_drawn_and_differ():
    spec = vqa.make_example(0, kind="gui").specs[0]
    e = spec.elements[0]
    other = vqa.LABELS[(vqa.LABELS.index(e.label) + 1) % len(vqa.LABELS)]
    relabelled = vqa.ImageSpec("gui", spec.size, spec.seed, (vqa.Element(e.kind, e.colour, other, e.cell),))
    original = vqa.ImageSpec("gui", spec.size, spec.seed, (e,))
    x0, y0, x1, y1 = vqa.cell_box(spec.size, e.cell)
    assert not np.array_equal(vqa.render(original)[y0:y1, x0:x1], vqa.render(relabelled)[y0:y1, x0:x1])
    page = vqa.make_example(0, kind="docs").specs[0]
    assert not np.array_equal(vqa.render(page), vqa.render(vqa.ImageSpec("docs", page.size, page.seed,
                                                                         title="Memo" if page.title != "Memo" else "Notes",
                                                                         lines=page.lines)))


def test_text_without_freetype_falls_back_to_the_scaled_bitmap_font(monkeypatch):
    monkeypatch.setattr(vqa, "_font", lambda px: None)
    spec = vqa.ImageSpec("gui", (112, 112), 12345, (vqa.Element("button", "blue", "Save", "center"),))
    img = vqa.render.__wrapped__(spec)
    x0, y0, x1, y1 = vqa.cell_box(spec.size, "center")
    assert np.any(np.all(img[y0:y1, x0:x1] == (255, 255, 255), axis=-1))  # white text on the blue button
    page = vqa.render.__wrapped__(vqa.ImageSpec("docs", (112, 112), 1, title="Memo", lines=(("apple", "river"),) * 2))
    assert (page < 100).any()


def test_describe_and_messages():
    ex = vqa.make_example(3, num_images=2, kind="mixed")
    for s in ex.specs:
        d = vqa.describe(s)
        if s.kind == "gui":
            assert d == "; ".join(f"{e.colour} {e.kind} {e.label} at {e.cell}" for e in s.elements)
        else:
            assert d.startswith(f"title {s.title}; line 1: {' '.join(s.lines[0])}")
    plain = vqa.messages(ex)
    assert [m["role"] for m in plain] == ["user", "assistant"] and plain[-1]["content"] == ex.answer
    parts = plain[0]["content"]
    assert [p["type"] for p in parts] == ["image", "image", "text"] and parts[-1]["text"] == ex.question
    assert all(p["image"] is im for p, im in zip(parts, ex.images))
    dense = vqa.messages(ex, dense=True, system="sys")
    assert [m["role"] for m in dense] == ["system", "user", "assistant"]
    assert dense[1]["content"][-1]["text"] == f"{ex.question} {vqa.DENSE_INSTRUCTION}"
    reply = dense[-1]["content"]
    assert all(vqa.describe(s) in reply for s in ex.specs) and reply.endswith(f"Answer: {ex.answer}")
    assert vqa.is_correct(reply, ex.answer) and vqa.is_correct(f" {ex.answer.upper()}.", ex.answer)
    assert not vqa.is_correct("Answer: nothing", ex.answer)
    assert [m["role"] for m in vqa.messages(ex, answer=False)] == ["user"]


def check_turns(turns):
    for t in turns:
        assert t.answer in t.choices
        assert len(t.images()) == len(t.image_ids) == len(t.specs)
        assert all(im is vqa.render(s) for im, s in zip(t.images(), t.specs))
        assert solve(list(t.specs), t.question) == t.answer
        assert t.messages[0]["role"] == "system" and t.messages[-1]["role"] == "user"


def test_gui_trace_slides_a_window():
    turns = vqa.trace(1, scenario="gui", turns=7, window=3)
    check_turns(turns)
    ids = [t.image_ids for t in turns]
    assert [len(i) for i in ids] == [1, 2, 3, 3, 3, 3, 3]
    for prev, cur in itertools.pairwise(ids[2:]):
        assert cur[:-1] == prev[1:] and cur[-1] not in prev
    # the same image, moved up one position, is the same pixels
    assert np.array_equal(turns[3].images()[0], turns[2].images()[1])


def test_reorder_trace_shows_pages_in_a_new_order_every_turn():
    turns = vqa.trace(2, scenario="reorder", turns=8, window=3)
    check_turns(turns)
    assert all(a.image_ids != b.image_ids for a, b in itertools.pairwise(turns))
    pos = {}
    for t in turns:
        for p, i in enumerate(t.image_ids):
            pos.setdefault(i, set()).add(p)
    assert any(len(p) > 1 for p in pos.values())  # some page shown at several positions
    assert all(s.kind == "docs" for t in turns for s in t.specs)


def test_subagent_trace_changes_system_prompts_and_keeps_history():
    turns = vqa.trace(5, scenario="subagent", turns=6, window=3)
    check_turns(turns)
    assert [t.label for t in turns] == ["plan", "branch 0", "branch 1", "branch 2", "continue 0", "continue 1"]
    systems = [t.messages[0]["content"] for t in turns[:4]]
    assert len(set(systems)) == 4
    assert all(a.image_ids != b.image_ids for a, b in itertools.pairwise(turns[:4]))
    assert sorted(turns[1].image_ids) == sorted(turns[0].image_ids)
    for prev, cur in itertools.pairwise(turns[3:]):  # continuing: the previous request, its answer, a new question
        assert cur.messages[:len(prev.messages)] == prev.messages
        assert cur.messages[len(prev.messages)] == {"role": "assistant", "content": prev.answer}
        assert isinstance(cur.messages[-1]["content"], str) and cur.image_ids == prev.image_ids
    assert len(vqa.trace(0, scenario="subagent", turns=1)) == 1


def test_handoff_trace_moves_images_but_keeps_their_order():
    turns = vqa.trace(6, scenario="handoff", turns=6, window=3)
    check_turns(turns)
    assert all(t.image_ids == (0, 1, 2) for t in turns)
    for prev, cur in itertools.pairwise(turns):
        assert all(np.array_equal(a, b) for a, b in zip(prev.images(), cur.images(), strict=True))
        # Another agent's system prompt, of another length: the images sit at other positions.
        assert len(prev.messages[0]["content"]) != len(cur.messages[0]["content"])
    assert len({t.question for t in turns}) > 1


@pytest.mark.parametrize("scenario", vqa.SCENARIOS)
@pytest.mark.parametrize("window", [1, 2, 4])
def test_traces_answers_derivable_for_any_window(scenario, window):
    for seed in range(3):
        turns = vqa.trace(seed, scenario=scenario, turns=5, window=window)
        assert len(turns) == 5
        check_turns(turns)


@pytest.mark.parametrize("scenario", vqa.SCENARIOS)
def test_dense_traces_ask_for_descriptions_and_leave_room_for_them(scenario):
    plain, dense = vqa.trace(7, scenario=scenario, turns=6), vqa.trace(7, scenario=scenario, turns=6, dense=True)
    for p, d in zip(plain, dense, strict=True):
        assert (d.answer, d.image_ids, d.question_type) == (p.answer, p.image_ids, p.question_type)
        assert d.question == f"{p.question} {vqa.DENSE_INSTRUCTION}"
        assert d.max_new_tokens == vqa.dense_token_budget(len(d.image_ids)) > p.max_new_tokens == 8
        assert p.messages[0]["content"].endswith(vqa.ANSWER_HINT) and vqa.ANSWER_HINT not in d.messages[0]["content"]
    for prev, cur in itertools.pairwise(dense):  # scripted history replies are dense replies
        if cur.label.startswith("continue"):
            scripted = cur.messages[len(prev.messages)]["content"]
            assert all(vqa.describe(s) in scripted for s in prev.specs) and scripted.endswith(f"Answer: {prev.answer}")


@pytest.mark.parametrize("kind", ["gui", "docs", "mixed"])
def test_evidence_repeats_the_part_of_the_description_that_holds_the_answer(kind):
    for seed in range(150):
        ex = vqa.make_example(vqa.split_seed("train", seed), num_images=1 + seed % 4, kind=kind, size=(84, 84))
        found = vqa.evidence_line(ex)
        reply = vqa.dense_reply(ex, evidence=True)
        assert reply == vqa.dense_reply(ex).replace("\nAnswer:", f"\nFound: {found}\nAnswer:")
        spec = ex.specs[ex.target_image]
        place = f"{vqa.ORDINALS[ex.target_image]} {'page' if kind == 'docs' else ('image' if kind == 'mixed' else 'screenshot')}"
        if ex.question_type == "which":
            # every image before the target checked and found without the element, then the target
            *misses, hit = found.split("; ")
            keys, _, body = hit.partition(": ")
            noun = place.split()[-1]
            assert [m.partition(": ") for m in misses] == [(f"{vqa.ORDINALS[i]} {noun}, {keys.partition(', ')[2]}", ": ", "none")
                                                          for i in range(ex.target_image)]
            assert keys.startswith(f"{place}, ") and body in vqa.describe(spec)
            label, element_kind = keys.partition(", ")[2].split()
            assert not any(e.label == label and e.kind == element_kind for s in ex.specs[:ex.target_image] for e in s.elements)
            continue
        keys, _, body = found.partition(": ") if ": " in found else ("", "", found)
        if ex.question_type == "which_page":
            assert found.endswith(f": the {place}")  # the looked-up key first, the image's ordinal last
        else:
            if len(ex.specs) > 1:
                assert keys.startswith(f"{place}")
            assert body in vqa.describe(spec)  # a copy of the target image's description
            assert ex.answer in body
        if spec.kind == "gui":  # the keys are words of the question
            assert all(word in ex.question for word in keys.replace(",", "").split() if word not in ("the", "at"))
        assert vqa.is_correct(reply, ex.answer)


def test_framed_messages_frame_an_example_as_the_traces_do():
    seen = {"system": 0, "step": 0, "follow_up": 0}
    for seed in range(200):
        ex = vqa.make_example(vqa.split_seed("train", seed), num_images=1 + seed % 3, size=(84, 84))
        msgs = vqa.framed_messages(ex, seed)
        assert msgs == vqa.framed_messages(ex, seed)  # deterministic per seed
        assert msgs[-1]["role"] == "assistant" and vqa.describe(ex.specs[0]) in msgs[-1]["content"]
        user = next(m for m in msgs if m["role"] == "user")
        assert user["content"][-1]["text"].endswith(f"{ex.question} {vqa.DENSE_INSTRUCTION}")
        assert [p["image"] for p in user["content"] if p["type"] == "image"] == ex.images
        if msgs[0]["role"] == "system":
            seen["system"] += 1
            assert any(msgs[0]["content"] == t.format(index=i) for t in vqa.SYSTEM_PROMPTS.values() for i in range(4))
        seen["step"] += user["content"][-1]["text"].startswith("Step ")
        if len(msgs) > 2 + (msgs[0]["role"] == "system"):
            seen["follow_up"] += 1
            assert msgs[-3]["content"] == vqa.dense_reply(ex) and isinstance(msgs[-2]["content"], str)
            assert msgs[-2]["content"].endswith(vqa.DENSE_INSTRUCTION)
            question = msgs[-2]["content"].removesuffix(f" {vqa.DENSE_INSTRUCTION}")
            assert msgs[-1]["content"].endswith(f"Answer: {solve(list(ex.specs), question)}")
    assert all(20 < v < 150 for v in seen.values()), seen
    plain = vqa.framed_messages(ex, 3, dense=False)
    assert "Describe" not in str(plain)


@pytest.mark.parametrize("call, match", [
    (lambda: vqa.make_example(0, kind="video"), "unknown kind"),
    (lambda: vqa.make_example(0, question="why"), "unknown question"),
    (lambda: vqa.make_example(0, kind="gui", question="title"), "about docs images"),
    (lambda: vqa.make_example(0, num_images=1, question="which"), "at least 2 images"),
    (lambda: vqa.make_example(0, num_images=0), "num_images"),
    (lambda: vqa.make_example(0, num_images=5), "num_images"),
    (lambda: vqa.make_example(0, num_images=True), "num_images"),
    (lambda: vqa.make_example(0, size=(20, 20)), "size"),
    (lambda: vqa.make_example(0, size=(112,)), "size"),
    (lambda: vqa.make_example(0, size="112"), "size"),
    (lambda: vqa.make_example(0, size=(112.0, 112)), "size"),
    (lambda: vqa.make_example(-1), "seed"),
    (lambda: vqa.examples("val", 3), "unknown split"),
    (lambda: vqa.examples("train", -1), "n must"),
    (lambda: vqa.examples("train", 3, seed=2**31), "seed"),
    (lambda: vqa.examples("train", 3, num_images=9), "num_images"),
    (lambda: vqa.trace(0, scenario="chat"), "unknown scenario"),
    (lambda: vqa.trace(0, turns=0), "turns"),
    (lambda: vqa.trace(0, window=5), "window"),
    (lambda: vqa.trace(0, size=(112, 4096)), "size"),
])
def test_bad_arguments_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("num_images", [1, 3])
def test_described_parts_scores_each_part_of_each_images_line(num_images):
    ex = vqa.make_example(11, num_images=num_images, size=(84, 84))
    parts = [p for s in ex.specs for p in vqa.describe(s).split("; ")]
    reply = vqa.dense_reply(ex, evidence=True)
    assert vqa.described_parts(reply, ex.specs) == [True] * len(parts)
    first = str(ex.specs[0].elements[0])
    other = next(c for c in vqa.COLOURS if c != ex.specs[0].elements[0].colour)
    wrong = reply.replace(first, first.replace(ex.specs[0].elements[0].colour, other, 1), 1)
    assert vqa.described_parts(wrong, ex.specs) == [False] + [True] * (len(parts) - 1)
    assert vqa.described_parts("Answer: x", ex.specs) == [False] * len(parts)
    with pytest.raises(TypeError, match="reply must be a str"):
        vqa.described_parts(None, ex.specs)
    with pytest.raises(ValueError, match="non-empty sequence of ImageSpec"):
        vqa.described_parts(reply, [])
    if num_images > 1:  # a line under another image's ordinal counts for that image only
        lines = reply.splitlines()
        swapped = "\n".join([lines[1].replace("Second", "First", 1), lines[0].replace("First", "Second", 1), *lines[2:]])
        scored = vqa.described_parts(swapped, ex.specs)
        n0, n1 = (len(vqa.describe(s).split("; ")) for s in ex.specs[:2])
        assert scored[n0 + n1:] == [True] * (len(parts) - n0 - n1)
        assert not all(scored[:n0 + n1])
