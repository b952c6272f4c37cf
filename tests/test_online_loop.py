"""The online step loop: requests that arrive while others decode join the running batch, tokens
stream as they are sampled, a cancelled request frees its blocks, and every reply equals serving
the request alone."""

import threading

import pytest

pytest.importorskip("transformers")

from samcache.engine import ChatRequest, screenshot  # noqa: E402
from samcache.engine.online import LoopStopped  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402
from samcache.errors import PromptTooLong, RequestCancelled  # noqa: E402

from engine_helpers import SIZE, assert_clean, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def path(tiny_checkpoints):
    return tiny_checkpoints["qwen2_5_vl"]


def request(i, tokens=8, **kw):
    return ChatRequest(messages=[{"role": "system", "content": f"You are agent number {i}."},
                                 user_message([screenshot(7000 + i, SIZE)], f"What should agent {i} click?")],
                       max_new_tokens=tokens, ignore_eos=True, **kw)


def test_requests_arriving_while_others_decode_join_the_batch_and_equal_serving_alone(path):
    engine = make_engine(path)
    alone = make_engine(path, share_weights_with=engine)
    reqs = [request(i, tokens=12 if i == 0 else 4) for i in range(4)]
    expected = [alone.chat(**vars(r)) for r in reqs]
    rows_per_step = []
    real = engine.executor.forward
    engine.executor.forward = lambda s: rows_per_step.append([int(x.rows.size) for x in s]) or real(s)
    loop = engine.start_online()
    try:
        streamed, decoding, arrived = [], threading.Event(), threading.Event()

        def hold_the_first_token(token):  # the loop waits here, request 0 decoding, until the others are queued
            streamed.append(token)
            if len(streamed) == 1:
                decoding.set()
                assert arrived.wait(60)

        first = loop.submit(reqs[0], on_token=hold_the_first_token)
        assert decoding.wait(60)
        later = [loop.submit(r) for r in reqs[1:]]
        arrived.set()
        results = [first.result(60)] + [h.result(60) for h in later]
    finally:
        loop.stop()
    assert not loop.running and loop.error is None
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert streamed == results[0].token_ids  # every token handed out as it was sampled, in order
    # The late requests were prefilled in steps that also decoded request 0 (a step with a decode row
    # beside a prefill), not after it finished.
    assert any(1 in s and max(s) > 1 for s in rows_per_step[1:])
    assert len(rows_per_step) < 12 + 3 * 4
    assert_clean(engine)


def test_chat_and_chat_batch_from_other_threads_go_through_the_running_loop(path):
    engine = make_engine(path)
    alone = make_engine(path, share_weights_with=engine)
    reqs = [request(10 + i, tokens=5) for i in range(6)]
    expected = [alone.chat(**vars(r)).token_ids for r in reqs]
    loop = engine.start_online()
    assert engine.start_online() is loop  # one loop per engine
    got = [None] * len(reqs)

    def one(i):
        got[i] = engine.chat(**vars(reqs[i])).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    batch = engine.chat_batch(reqs[3:])
    for t in threads:
        t.join(60)
    loop.stop()
    assert got[:3] == expected[:3]
    assert [r.token_ids for r in batch] == expected[3:]
    assert loop.steps > 0  # they were served by the loop's thread
    assert_clean(engine)


def test_a_cancelled_request_frees_its_blocks_and_the_others_go_on(path):
    engine = make_engine(path, image_kv_cache=False)  # no image records: every block is free or cached after
    loop = engine.start_online()
    try:
        seen, third, cancelled = [], threading.Event(), threading.Event()

        def cancel_at_the_third_token(token):
            seen.append(token)
            if len(seen) == 3:
                third.set()
                assert cancelled.wait(60)

        long = loop.submit(request(20, tokens=200), on_token=cancel_at_the_third_token)
        short = loop.submit(request(21, tokens=6))
        assert third.wait(60)
        long.cancel()
        cancelled.set()
        with pytest.raises(RequestCancelled, match="cancelled while it decoded"):
            long.result(60)
        assert len(seen) == 3  # ended at the next step
        assert len(short.result(60).token_ids) == 6
        queued = loop.submit(request(22, tokens=200))
        queued.cancel()
        with pytest.raises(RequestCancelled):
            queued.result(60)
    finally:
        loop.stop()
    assert_clean(engine)
    stats = engine.pool.stats()
    assert stats["live_sequences"] == 0
    assert stats["free_blocks"] + stats["evictable_blocks"] == stats["num_blocks"]  # the decode's blocks are back


def test_bad_requests_fail_alone_and_a_stopped_loop_takes_no_more(path):
    import numpy as np

    engine = make_engine(path)
    loop = engine.start_online()
    good = loop.submit(request(30, tokens=3))
    bad = loop.submit(ChatRequest(images=[np.zeros((8, 8, 3), np.float32)], prompt="x"))
    with pytest.raises(ValueError):
        bad.result(60)
    assert len(good.result(60).token_ids) == 3
    loop.stop()
    with pytest.raises(LoopStopped, match="not running"):
        loop.submit(request(31))
    # Without the loop the engine serves as before.
    assert len(engine.chat(**vars(request(32, tokens=2))).token_ids) == 2
    assert_clean(engine)


def test_a_callback_that_returns_true_ends_the_request_as_a_stop(path):
    engine = make_engine(path)
    loop = engine.start_online(max_model_len=4096)
    try:
        seen = []
        handle = loop.submit(request(40, tokens=50), on_token=lambda t: seen.append(t) or len(seen) == 3)
        result = handle.result(60)
        assert result.token_ids == seen and len(seen) == 3 and result.finish_reason == "stop"
    finally:
        loop.stop()
    assert_clean(engine)


def test_max_model_len_bounds_prompt_and_reply_and_fill_decodes_up_to_it(path):
    from samcache.errors import PromptTooLong

    engine = make_engine(path)
    prompt_len = len(engine.build_prompt(request(50).messages))
    loop = engine.start_online(max_model_len=prompt_len + 5)
    try:
        with pytest.raises(PromptTooLong, match="max_model_len"):
            loop.submit(request(50, tokens=6)).result(60)
        assert len(loop.submit(request(50, tokens=5)).result(60).token_ids) == 5
        filled = loop.submit(request(50, tokens=1), fill=True).result(60)  # max_new_tokens ignored
        assert len(filled.token_ids) == 5 and filled.finish_reason == "length"
    finally:
        loop.stop()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.start_online().submit(request(51), fill=True)
    engine._online.stop()
    assert_clean(engine)


def test_the_loop_cannot_be_reentered_from_its_thread_nor_stepped_beside_it(path):
    engine = make_engine(path)
    loop = engine.start_online()
    try:
        handle = loop.submit(request(60, tokens=4), on_token=lambda t: engine.chat(prompt="x", max_new_tokens=1))
        with pytest.raises(RuntimeError, match="online loop's thread"):
            handle.result(60)
        with pytest.raises(RuntimeError, match="before start_online"):
            engine.warm_up()
        assert len(loop.submit(request(61, tokens=2)).result(60).token_ids) == 2  # the loop goes on
    finally:
        loop.stop()
    assert_clean(engine)


def test_bad_arguments_are_clear_errors(path):
    engine = make_engine(path)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.start_online(max_model_len=1)
    loop = engine.start_online()
    try:
        with pytest.raises(TypeError, match="submit takes a ChatRequest or PreparedChat, got dict"):
            loop.submit({"prompt": "hi"})
        with pytest.raises(TypeError, match="on_token must be callable"):
            loop.submit(request(70), on_token="print")
        with pytest.raises(TypeError, match="fill must be a bool"):
            loop.submit(request(70), fill=1)
        with pytest.raises(ValueError, match="timeout"):
            loop.stop(timeout=-1)
        assert loop.running  # nothing above touched it
    finally:
        loop.stop()
    assert_clean(engine)


def test_prepared_requests_are_built_in_the_callers_thread_and_answer_as_the_plain_ones(path):
    """engine.prepare builds the prompt (images decoded and hashed, text tokenized) where it is
    called: the loop's thread then builds nothing between two steps, and the reply is the same."""
    engine = make_engine(path)
    built_in = []
    real = engine.build_prompt
    engine.build_prompt = lambda messages: built_in.append(threading.current_thread().name) or real(messages)
    plain = engine.chat(**vars(request(1, tokens=5)))
    built_in.clear()
    prepared = [engine.prepare(request(i, tokens=5)) for i in (1, 2)]
    assert built_in == [threading.current_thread().name] * 2
    loop = engine.start_online(max_model_len=4096)
    try:
        got = [loop.submit(p).result(60) for p in prepared]
        bad = engine.prepare(ChatRequest(messages=[user_message([], "hi")], max_new_tokens=5000))
        with pytest.raises(PromptTooLong, match="max_model_len of 4096"):  # the admission still checks it
            loop.submit(bad).result(60)
        with pytest.raises(TypeError, match="submit takes a ChatRequest or PreparedChat, got str"):
            loop.submit("hello")
    finally:
        loop.stop()
    assert "samcache-step-loop" not in built_in and len(built_in) == 3
    assert got[0].token_ids == plain.token_ids
    with pytest.raises(TypeError, match="prepare takes a ChatRequest"):
        engine.prepare("hello")
    with pytest.raises(ValueError, match="either messages"):
        engine.prepare(ChatRequest(messages=[user_message([], "hi")], prompt="also"))
    assert_clean(engine)


def test_announced_requests_start_in_one_prefill_step_and_a_lone_one_is_not_held(path):
    """Requests announced together (a server announces each as it arrives, before parsing it) are
    prefilled in one step even when submitted apart; a request with nothing else announced, or
    whose announcements were released, starts at once; an announcement never released holds the
    idle loop no longer than gather_s."""
    engine = make_engine(path)
    alone = make_engine(path, share_weights_with=engine)
    reqs = [request(80 + i, tokens=3) for i in range(3)]
    expected = [alone.chat(**vars(r)).token_ids for r in reqs]
    rows_per_step = []
    real = engine.executor.forward
    engine.executor.forward = lambda s: rows_per_step.append([int(x.rows.size) for x in s]) or real(s)
    loop = engine.start_online(gather_s=10)
    try:
        arrivals = [loop.announce() for _ in reqs]
        first = loop.submit(reqs[0], arrival=arrivals[0])
        late = []
        submitter = threading.Timer(0.5, lambda: late.extend(loop.submit(r, arrival=a)
                                                             for r, a in zip(reqs[1:], arrivals[1:])))
        submitter.start()
        got = [first.result(60).token_ids]
        submitter.join()
        got += [h.result(60).token_ids for h in late]
        assert got == expected
        # One prefill step for all three (then two decode steps), after waiting for the late two.
        assert len(rows_per_step) == 3 and len(rows_per_step[0]) == 3 and min(rows_per_step[0]) > 1
        assert 0.4 < loop.gathered_s < 10

        held = loop.gathered_s
        loop.announce().release()  # a request refused before its submission
        assert loop.submit(request(90, tokens=2)).result(60).token_ids  # nothing else announced: not held
        assert loop.gathered_s - held < 0.2

        stray = loop.announce()  # never submitted nor released (its client still uploading)
        loop.gather_s = 0.3
        held = loop.gathered_s
        assert loop.submit(request(91, tokens=2)).result(60).token_ids
        assert 0.25 < loop.gathered_s - held < 5
        stray.release()
        stray.release()  # once only
        assert loop._announced == 0
        with pytest.raises(TypeError, match="arrival must be an Arrival"):
            loop.submit(request(92), arrival="soon")
    finally:
        loop.stop()
    assert_clean(engine)
    with pytest.raises(ValueError, match="gather_s"):
        make_engine(path).start_online(gather_s=-1)


def test_a_loop_stepped_on_the_callers_thread_serves_until_stopped_from_another(path):
    """own_thread=False: requests submitted before run() wait in the queue; run() steps them on the
    thread that started the loop, and returns once another thread stops the loop."""
    engine = make_engine(path)
    alone = make_engine(path, share_weights_with=engine)
    reqs = [request(100 + i, tokens=3) for i in range(2)]
    expected = [alone.chat(**vars(r)).token_ids for r in reqs]
    loop = engine.start_online(own_thread=False)
    stepped_on = []
    real = engine.executor.forward
    engine.executor.forward = lambda s: stepped_on.append(threading.current_thread()) or real(s)
    assert loop.running and loop.in_loop_thread()
    early = loop.submit(reqs[0])  # queued: nothing steps yet
    with pytest.raises(RuntimeError, match="from the online loop's thread"):
        engine.chat(**vars(reqs[1]))
    results = []

    def client():
        try:
            results.append(early.result(60).token_ids)
            results.append(loop.submit(reqs[1]).result(60).token_ids)
        finally:
            loop.stop(30)  # whatever happened: run() below returns

    other = threading.Thread(target=client)
    other.start()
    loop.run()  # returns once the client thread stopped the loop
    other.join()
    assert results == expected
    assert set(stepped_on) == {threading.current_thread()} and not loop.running and loop.error is None
    with pytest.raises(LoopStopped):
        loop.submit(reqs[0])
    with pytest.raises(RuntimeError, match="has run already"):
        loop.run()
    threaded = make_engine(path).start_online()
    try:
        with pytest.raises(RuntimeError, match="own_thread=False"):
            threaded.run()
    finally:
        threaded.stop()
    with pytest.raises(TypeError, match="own_thread"):
        make_engine(path).start_online(own_thread="no")
    assert_clean(engine)

    # Stopped before it ran: what was queued is refused, and run() returns at once.
    unrun = make_engine(path).start_online(own_thread=False)
    queued = unrun.submit(request(102, tokens=2))
    stopper = threading.Thread(target=unrun.stop)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive() and not unrun.running
    with pytest.raises(LoopStopped, match="before it ran"):
        queued.result(1)
    unrun.run()


def test_stop_wakes_a_loop_holding_its_first_step_for_announced_requests(path):
    engine = make_engine(path)
    loop = engine.start_online(gather_s=10)
    stray = loop.announce()  # never submitted: the loop would hold its first step for 10 s
    handle = loop.submit(request(110, tokens=2))
    import time

    time.sleep(0.3)  # the loop took the request and holds its first step
    start = time.perf_counter()
    loop.stop(30)  # the held request is finished, not cancelled, without waiting out gather_s
    assert time.perf_counter() - start < 5
    assert len(handle.result(1).token_ids) == 2
    stray.release()
    assert_clean(engine)
