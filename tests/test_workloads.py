"""Agent workload traces: deterministic per seed, shaped as each scenario promises."""

import numpy as np
import pytest

from samcache.bench.workloads import SCENARIOS, ImageRef, make_trace, materialize

SMALL = (56, 84)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_traces_are_deterministic_for_a_seed(scenario):
    a = make_trace(scenario, seed=3, size=SMALL)
    b = make_trace(scenario, seed=3, size=SMALL)
    c = make_trace(scenario, seed=4, size=SMALL)
    assert a.to_json() == b.to_json()
    assert a.to_json() != c.to_json()
    ref = a.turns[0].images()[0]
    draw = materialize.__wrapped__  # bypass the cache: two independent drawings must agree
    assert np.array_equal(draw(ref), draw(ImageRef(ref.kind, ref.seed, ref.size)))
    assert draw(ref).shape == (*SMALL, 3)
    assert not np.array_equal(draw(ref), draw(ImageRef(ref.kind, ref.seed + 1, ref.size)))


def test_gui_slides_a_window_so_images_repeat_at_new_positions():
    t = make_trace("gui", turns=6, window=4, size=SMALL)
    windows = [turn.images() for turn in t.turns]
    assert [len(w) for w in windows] == [1, 2, 3, 4, 4, 4]
    for prev, cur in zip(windows[3:], windows[4:]):
        assert cur[:-1] == prev[1:] and cur[-1] not in prev  # oldest dropped, one new, the rest moved up
    assert t.summary()["distinct_images"] == 6


def test_new_content_keeps_only_first_seen_images_and_the_last_text():
    gui = make_trace("gui", turns=6, window=4, size=SMALL)
    for t, turn in enumerate(gui.turns):
        cut = gui.new_content(t)
        assert cut.images() == [turn.images()[-1]]  # the one new screenshot of the turn
        assert cut.messages[0] == turn.messages[0] and cut.messages[0]["role"] == "system"
        assert cut.messages[-1]["content"][-1] == turn.messages[-1]["content"][-1]  # the question, verbatim
    br = make_trace("branch", branches=2, images=3, continue_turns=2, size=SMALL)
    assert len(br.new_content(0).images()) == 3  # the planner sees every image first
    for t in range(1, len(br.turns)):
        cut = br.new_content(t)
        assert cut.images() == [] and len(cut.messages) == 2
        last = br.turns[t].messages[-1]["content"]
        assert cut.messages[-1]["content"][-1]["text"] == (last if isinstance(last, str) else last[-1]["text"])
    d = make_trace("docs", turns=6, pages=6, per_turn=3, size=SMALL)
    first_seen = set()
    for t, turn in enumerate(d.turns):
        new = [r for r in dict.fromkeys(turn.images()) if r not in first_seen]
        assert d.new_content(t).images() == new
        first_seen |= set(turn.images())
    with pytest.raises(ValueError, match="outside"):
        d.new_content(6)
    for trace in (gui, br, d):  # the one-pass list is the same as turn by turn
        assert trace.new_contents() == [trace.new_content(t) for t in range(len(trace.turns))]


def test_gui_defaults_to_a_window_of_four():
    t = make_trace("gui", turns=6, size=SMALL)
    assert max(len(turn.images()) for turn in t.turns) == 4 and t.params["window"] == 4


def test_docs_branch_and_chat_shapes():
    d = make_trace("docs", turns=6, pages=6, per_turn=3, size=SMALL)
    shown = [tuple(turn.images()) for turn in d.turns]
    assert all(len(s) == 3 for s in shown)
    assert len({img for s in shown for img in s}) > 3  # pages are revisited, not always the same three
    assert len(set(shown)) > 1 and len({turn.messages[1]["content"][-1]["text"] for turn in d.turns}) == 6
    assert any(set(a) & set(b) and a != b for a in shown for b in shown)  # a page comes back in another slot
    b = make_trace("branch", branches=3, images=2, continue_turns=2, size=SMALL)
    assert [turn.label for turn in b.turns] == ["plan", "branch 0", "branch 1", "branch 2", "continue 0", "continue 1"]
    assert len({turn.messages[0]["content"] for turn in b.turns[:4]}) == 4  # a system prompt each
    assert all(turn.images() == b.turns[0].images() for turn in b.turns)
    chosen = b.turns[4].messages[:2]  # the continuation extends one sub-agent's conversation
    assert chosen in [turn.messages for turn in b.turns[1:4]]
    assert b.turns[5].messages[: len(b.turns[4].messages)] == b.turns[4].messages
    c = make_trace("chat", turns=3, size=SMALL)
    assert [len(turn.messages) for turn in c.turns] == [2, 4, 6]  # history grows, one image throughout
    assert c.turns[1].messages[:2] == c.turns[0].messages


def test_unknown_scenario_or_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; choose from gui, docs, branch, chat"):
        make_trace("nope")
    with pytest.raises(ValueError, match="scenario 'gui' has no parameter 'pages'; its parameters: seed, turns, window"):
        make_trace("gui", pages=3)
    with pytest.raises(ValueError, match="'branch' has no parameter 'turns'.*continue_turns"):
        make_trace("branch", turns=3)
    with pytest.raises(ValueError, match="turns must be an int >= 1"):
        make_trace("chat", turns=0)
    with pytest.raises(ValueError, match="per_turn"):
        make_trace("docs", pages=2, per_turn=3)
    with pytest.raises(ValueError, match="size must be"):
        make_trace("gui", size=(0, 84))
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_trace("chat", max_new_tokens=0)


def test_synthetic_images_check_their_size():
    from samcache.synthetic import document_page, screenshot

    for draw in (screenshot, document_page):
        with pytest.raises(ValueError, match="size must be"):
            draw(0, (0, 100))
        with pytest.raises(ValueError, match="size must be"):
            draw(0, 720)
