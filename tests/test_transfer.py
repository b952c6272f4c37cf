"""The transfer engine of the tiers: KV loaded into pool slots layer by layer, exactly where a
plain indexed write puts it, every layer in place when its wait returns; bad loads refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from samcache.cache.tiers.transfer import TransferEngine


def _caches(layers, blocks, bs, heads, dim, dtype=torch.float32):
    shape = (layers, blocks, bs, heads, dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 5), blocks=st.integers(1, 6), bs=st.sampled_from([1, 4, 16]), n=st.integers(0, 40),
       seed=st.integers(0, 2**31 - 1), threads=st.integers(1, 3), half=st.booleans())
def test_load_puts_every_row_where_an_indexed_write_does(layers, blocks, bs, n, seed, threads, half):
    rng = np.random.default_rng(seed)
    rows = blocks * bs
    n = min(n, rows)
    dtype = torch.bfloat16 if half else torch.float32
    k, v = _caches(layers, blocks, bs, 2, 8, dtype)
    slots = rng.permutation(rows)[:n]
    if n > 3:  # runs of consecutive slots, as a sequence's blocks give
        slots[: n // 2] = np.sort(slots[: n // 2])
    kv = torch.from_numpy(rng.standard_normal((layers, 2, n, 2, 8))).to(torch.float64)
    want_k, want_v = k.clone(), v.clone()
    flat = (layers, rows, 2, 8)
    want_k.view(flat)[:, torch.from_numpy(slots)] = kv[:, 0].to(dtype)
    want_v.view(flat)[:, torch.from_numpy(slots)] = kv[:, 1].to(dtype)
    engine = TransferEngine(k, v, num_threads=threads)
    load = engine.load(kv, slots)
    for layer in range(layers):
        load.wait(layer)  # this layer is complete now, whatever the later ones are doing
        torch.testing.assert_close(k[layer], want_k[layer], equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(v[layer], want_v[layer], equal_nan=True, rtol=0, atol=0)
    load.release()
    load.release()  # idempotent
    assert load.copy_seconds >= 0 and engine.stats()["jobs"] == 1


def test_bad_loads_are_refused():
    k, v = _caches(2, 2, 4, 1, 4)
    engine = TransferEngine(k, v)
    kv = torch.zeros(2, 2, 3, 1, 4)
    with pytest.raises(ValueError, match="kv must be"):
        engine.load(kv, np.array([0, 1]))
    with pytest.raises(ValueError, match="outside|must be in"):
        engine.load(kv, np.array([0, 1, 8]))
    with pytest.raises(ValueError, match="distinct"):
        engine.load(kv, np.array([0, 1, 1]))
    load = engine.load(kv, np.array([5, 6, 7]))
    with pytest.raises(ValueError, match="outside the load"):
        load.wait(2)
    load.release()
    with pytest.raises(ValueError, match="same shape"):
        TransferEngine(k, v[:1])
    with pytest.raises(ValueError, match="num_threads"):
        TransferEngine(k, v, num_threads=0)


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about `seconds` (calibrated here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1e3 / max(start.elapsed_time(end), 1e-3))


@pytest.mark.cuda
def test_cuda_loads_land_layer_by_layer_on_a_side_stream():
    """On CUDA the load runs on the engine's side stream: load() returns while the compute stream
    is still busy (the host never waits), the copies run while compute queued after load() runs
    (overlap, checked with events), and wait(l) orders the compute stream after layer l's copy,
    so a kernel enqueued after it reads the loaded rows."""
    device = torch.device("cuda")
    k, v = (t.to(device) for t in _caches(4, 8, 16, 2, 64, torch.bfloat16))
    engine = TransferEngine(k, v)
    rng = np.random.default_rng(0)
    slots = rng.permutation(8 * 16)[:100]
    kv = torch.randn(4, 2, 100, 2, 64).pin_memory()  # float32 into bfloat16 caches: converted on the GPU
    engine.load(kv, slots).release()  # warm-up: kernels loaded, pinned buffers cached
    k.fill_(float("nan")), v.fill_(float("nan"))
    compute = torch.cuda.current_stream()
    cycles = _sleep_cycles(0.3)

    torch.cuda._sleep(cycles)  # work queued before the load: its copies wait for it on the GPU only
    earlier_done = torch.cuda.Event()
    earlier_done.record(compute)
    load = engine.load(kv, slots)
    assert not earlier_done.query(), "load() made the host wait for the compute stream"
    copies_done = torch.cuda.Event()
    copies_done.record(engine._stream)  # after every copy of the load on the side stream
    torch.cuda._sleep(cycles)  # compute queued after the load (e.g. the current layer)
    later_done = torch.cuda.Event()
    later_done.record(compute)
    copies_done.synchronize()
    assert earlier_done.query(), "the copies ran before the work queued ahead of them"
    assert not later_done.query(), "the copies did not overlap the compute stream"

    index = torch.from_numpy(slots).to(device)
    for layer in range(4):
        load.wait(layer)
        got = k[layer].view(-1, 2, 64).index_select(0, index)  # on the compute stream, after the wait
        torch.testing.assert_close(got.float().cpu(), kv[layer, 0].to(torch.bfloat16).float(), rtol=0, atol=0)
    load.release()
    torch.testing.assert_close(v.view(4, -1, 2, 64)[:, index].float().cpu(), kv[:, 1].to(torch.bfloat16).float(),
                               rtol=0, atol=0)
    untouched = torch.ones(8 * 16, dtype=torch.bool)
    untouched[torch.from_numpy(slots)] = False
    assert k.view(4, -1, 2, 64)[:, untouched.to(device)].isnan().all(), "rows outside the slots stay as they were"
    # Timed on the GPU's clock: the copy took time, and the stalls are part of it at most.
    assert load.copy_seconds > 0 and 0 <= load.waited_seconds <= load.copy_seconds + 1e-3
