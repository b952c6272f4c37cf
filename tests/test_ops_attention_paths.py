"""The GPU's attention paths against the same float64 reference as the native kernel.

The Triton kernel runs in Triton's interpreter on the CPU (float32 and float16: the interpreter
mishandles bfloat16), so CI checks its indexing, masking, key splits and metadata guards; the
CUDA tests run it and torch's flash path on a GPU, bfloat16 included, and check which path the
default dispatch takes. The flash path's layout (runs, gathered key slots) is planned on the host
and checked here without a GPU.
"""

import importlib
import math

import numpy as np
import pytest
import torch

from samcache.ops import AttentionMetadata, sparse_attention
from samcache.ops import attention_flash

from test_ops_sparse_attention import DTYPES, make_batch, reference

sparse_attention_module = importlib.import_module("samcache.ops.sparse_attention")
pytestmark = pytest.mark.long  # the Triton kernel in Triton's interpreter: about a minute

triton = pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    """attention_triton with its kernels in Triton's interpreter (set up by conftest.py on machines
    without a GPU). The interpreter turns a loop bound into an int with int(array), which NumPy
    >= 2.3 refuses for its 1-element arrays: the bound is read through .item() instead."""
    from triton.runtime import interpreter

    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton's interpreter is off (a GPU runs the compiled kernels: see the cuda tests)")
    patch_lang = interpreter._patch_lang

    def patched(fn):
        scope = patch_lang(fn)
        scope.set_attr(interpreter.tl.core.tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        return scope

    monkeypatch.setattr(interpreter, "_patch_lang", patched)
    from samcache.ops import attention_triton

    # Outputs start poisoned: an element the kernels do not write fails the comparison.
    monkeypatch.setattr(attention_triton, "_uninitialised", lambda shape, **kw: torch.full(shape, float("nan"), **kw))
    return attention_triton


def _shaped_call(module, q, meta, kc, vc, **kw):
    out, lse = module.paged_attention(q, meta, kc, vc, **kw)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    return out, lse


# (lengths, rows per sequence, block_size, kv heads, heads per kv head, head_dim)
SHAPES = [
    ([64], [64], 16, 1, 1, 16),          # a full prefill, one head
    ([300, 37, 129], [20, 37, 1], 16, 2, 7, 32),  # Qwen-like GQA group of 7, decode row, scattered rows
    ([500], [3], 4, 1, 4, 64),           # few rows, long keys: several splits
    ([90, 200], [90, 5], 1, 3, 2, 40),   # block_size 1, head_dim not a power of two
]


WINDOWS_AND_CAPS = [(-1, 0.0), (7, 0.0), (-1, 5.0), (60, 5.0)]


# Every shape with every window and cap; the two dtypes alternate across that grid, so each dtype
# meets every shape and every window/cap (Triton's interpreter makes each case seconds long).
@pytest.mark.parametrize("shape, window, cap, dtype", [
    (s, w, c, (torch.float32, torch.float16)[(s + i) % 2])
    for s in range(len(SHAPES)) for i, (w, c) in enumerate(WINDOWS_AND_CAPS)],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_triton_matches_reference(interpreted, dtype, shape, window, cap):
    lengths, rows, bs, hkv, g, d = SHAPES[shape]
    q, meta, kc, vc = make_batch(shape * 13 + 1, lengths, rows, 2, bs, hkv, g, d, dtype)
    scale = 1 / math.sqrt(d)
    ref_out, ref_lse = reference(q, meta, kc, vc, scale, window, cap)
    tol = DTYPES[dtype]
    for config in ({}, {"splits": 3, "block_m": 16, "block_n": 16}):  # the defaults; forced splits, small tiles
        out, lse = _shaped_call(interpreted, q, meta, kc, vc, scale=scale, window=window, logit_cap=cap,
                                  max_rows_per_seq=max(rows), config=config)
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


def test_triton_through_the_dispatch(interpreted):
    q, meta, kc, vc = make_batch(5, [80, 33], [9, 4], 1, 16, 2, 3, 16, torch.float32)
    before = sparse_attention_module.BACKEND_CALLS["triton"]
    out, lse = sparse_attention(q, meta, kc, vc, backend="triton")
    assert sparse_attention_module.BACKEND_CALLS["triton"] == before + 1
    ref_out, ref_lse = reference(q, meta, kc, vc, 1 / 4, -1, 0.0)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="q must be"):  # the op's own checks run first
        sparse_attention(q[0], meta, kc, vc, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_attention(q, meta, kc, vc, backend="fast")


def _bad_metadata_cases(meta, to):
    """(metadata, rows that must be NaN) for inconsistent device metadata (cf. row_keys)."""
    i64 = lambda *v: torch.tensor(v, dtype=torch.long, device=to)  # noqa: E731
    good = dict(q_pos=meta.q_pos, qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices,
                kv_last_page_len=meta.kv_last_page_len)
    cases = [
        (dict(qo_indptr=i64(0, 2)), [2, 3]),                       # rows past the last sequence
        (dict(kv_indptr=i64(0, 9)), [0, 1, 2, 3]),                 # pages past kv_indices
        (dict(kv_indptr=i64(-1, 3)), [0, 1, 2, 3]),                # pages before kv_indices
        (dict(kv_last_page_len=i64(17)), [0, 1, 2, 3]),            # more than a block
        (dict(kv_indices=meta.kv_indices.long().to(to) + 2**32), [0, 1, 2, 3]),  # no wrap to a valid page
    ]
    for change, nan_rows in cases:
        parts = {k: (v.to(to) if k not in change else change[k]) for k, v in good.items()}
        yield AttentionMetadata(parts["q_pos"], parts["qo_indptr"], parts["kv_indptr"], parts["kv_indices"],
                                parts["kv_last_page_len"], 64), nan_rows, change


@pytest.mark.parametrize("splits", [1, 2])
def test_triton_inconsistent_metadata_gives_nan(interpreted, splits):
    q, meta, kc, vc = make_batch(8, [64], [4], 0, 16, 1, 2, 64, torch.float16)
    ref_out, _ = reference(q, meta, kc, vc, 64**-0.5, -1, 0.0)
    for bad, nan_rows, change in _bad_metadata_cases(meta, "cpu"):
        # The kernels alone: on the CPU the op's checks would read this metadata and refuse it.
        out, lse = interpreted._launch(q, bad, kc, vc, scale=64**-0.5, window=-1, logit_cap=0.0, max_rows_per_seq=None,
                                       config={"splits": splits})
        ok_rows = [r for r in range(q.shape[0]) if r not in nan_rows]
        assert out[nan_rows].isnan().all() and lse[nan_rows].isnan().all(), change
        assert not out[ok_rows].isnan().any(), change
        torch.testing.assert_close(out[ok_rows].double(), ref_out[ok_rows], rtol=2e-3, atol=2e-3)


def test_tile_shapes():
    from samcache.ops import attention_triton

    assert attention_triton.tile_shape(7, 1) == (16, 2)      # decode: the smallest tensor-core tile
    assert attention_triton.tile_shape(7, 1000) == (128, 18)  # a prompt: 18 rows x 7 heads
    assert attention_triton.tile_shape(1, 5) == (16, 16)
    assert attention_triton.tile_shape(32, 3) == (128, 4)
    with pytest.raises(ValueError, match="at most 128"):
        attention_triton.tile_shape(200, 1)
    assert attention_triton.num_splits(32, 32768, 132) == 17        # 8 x 4 programs, 4 per multiprocessor
    assert attention_triton.num_splits(32, 32768, 132, per_sm=2) == 9  # decode tiles: 2 per multiprocessor
    assert attention_triton.num_splits(10_000, 32768, 132) == 1     # the grid is full already
    assert attention_triton.num_splits(1, 600, 132) == 2            # each split keeps >= 512 keys


def test_flash_layout_is_planned_on_the_host():
    """Runs of consecutive positions become flash's varlen batch; their keys' cache rows are
    gathered in order; anything else is not a flash batch."""
    bs = 4
    tables = [np.array([7, 2, 5]), np.array([1, 0])]
    runs = AttentionMetadata.build([np.arange(3, 10), np.array([6])], tables, [10, 7], bs)
    layout = attention_flash.plan_layout(runs.host, torch.device("cpu"))
    assert layout.cu_seq_q.tolist() == [0, 7, 8] and layout.cu_seq_k.tolist() == [0, 10, 17]
    assert (layout.max_q, layout.max_k, layout.min_q) == (7, 10, 1)
    want = [7 * bs + i for i in range(4)] + [2 * bs + i for i in range(4)] + [5 * bs, 5 * bs + 1]
    want += [1 * bs + i for i in range(4)] + [0 * bs + i for i in range(3)]
    assert layout.slots.tolist() == want
    assert layout.row_run.tolist() == [0] * 7 + [1] and layout.row_offset.tolist() == list(range(7)) + [0]
    gaps = AttentionMetadata.build([np.array([0, 2]), np.array([6])], tables, [10, 7], bs)
    assert attention_flash.plan_layout(gaps.host, torch.device("cpu")) is None
    # select() keeps the host copy only when given the host rows
    sub = runs.select(torch.tensor([1, 2, 7]), [2, 1], host_rows=np.array([1, 2, 7]))
    assert sub.host.q_pos.tolist() == [4, 5, 6] and sub.host.qo_indptr.tolist() == [0, 2, 3]
    assert runs.select(torch.tensor([1, 2, 7]), [2, 1]).host is None
    with pytest.raises(ValueError, match="host_rows must be"):
        runs.select(torch.tensor([1, 2, 7]), [2, 1], host_rows=np.array([1, 2]))


def test_auto_keeps_the_native_kernel_on_the_cpu():
    q, meta, kc, vc = make_batch(3, [40], [40], 0, 16, 1, 2, 16, torch.float32)
    before = dict(sparse_attention_module.BACKEND_CALLS)
    sparse_attention(q, meta, kc, vc)
    assert sparse_attention_module.BACKEND_CALLS["native"] == before.get("native", 0) + 1
    with pytest.raises(ValueError, match="backend 'flash' needs CUDA"):
        sparse_attention(q, meta, kc, vc, backend="flash")


# ---- on a GPU --------------------------------------------------------------------------------

CUDA_SHAPES = [
    ([2000], [2000], 16, 4, 7, 128),               # a prefill (one run): flash
    ([4000, 900], [300, 900], 16, 4, 7, 128),      # a suffix and a prefill (runs >= FLASH_MIN_RUN): flash
    ([5000, 3000, 70], [1, 1, 1], 16, 4, 7, 128),  # decode (runs of one row): Triton
    ([3000], [150], 16, 2, 8, 64),                 # scattered rows: Triton
]


def _cuda_batch(shape, dtype, scattered_ok=True):
    lengths, rows, bs, hkv, g, d = CUDA_SHAPES[shape]
    gen = np.random.default_rng(shape)
    positions = []
    for n, m in zip(lengths, rows):
        if m == n or shape in (1, 2):
            positions.append(np.arange(n - m, n))  # a run ending at the last token
        else:
            positions.append(np.sort(np.concatenate([gen.choice(n - 1, m - 1, replace=False), [n - 1]])))
    pages = [-(-n // bs) for n in lengths]
    num_blocks = sum(pages) + 3
    perm = gen.permutation(num_blocks)
    tables = np.split(perm[: sum(pages)], np.cumsum(pages)[:-1])
    meta = AttentionMetadata.build(positions, tables, lengths, bs, "cuda")
    g_ = torch.Generator().manual_seed(shape)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g_).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g_).to(dtype)
    q = torch.randn(int(meta.q_pos.numel()), hkv * g, d, generator=g_).to(dtype)
    cpu_meta = AttentionMetadata(*(t.cpu() for t in (meta.q_pos, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                                     meta.kv_last_page_len)), meta.max_kv_len)
    return q, meta, cpu_meta, kc, vc


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", range(len(CUDA_SHAPES)))
@pytest.mark.parametrize("window", [-1, 256])
def test_cuda_paths_match_reference(dtype, shape, window):
    q, meta, cpu_meta, kc, vc = _cuda_batch(shape, dtype)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = reference(q, cpu_meta, kc, vc, scale, window, 0.0)
    tol = DTYPES[dtype]
    expected = "flash" if shape in (0, 1) else "triton"
    for backend in ("auto", "triton", "native") + (("flash",) if shape in (0, 1, 2) else ()):
        before = dict(sparse_attention_module.BACKEND_CALLS)
        out, lse = sparse_attention(q.cuda(), meta, kc.cuda(), vc.cuda(), scale=scale, window=window, backend=backend)
        ran = expected if backend == "auto" else backend
        assert sparse_attention_module.BACKEND_CALLS[ran] == before.get(ran, 0) + 1, (backend, ran)
        assert not out.isnan().any(), backend
        torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol, msg=backend)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=tol, atol=tol, msg=backend)


@pytest.mark.cuda
def test_cuda_triton_logit_cap_and_float32():
    q, meta, cpu_meta, kc, vc = _cuda_batch(3, torch.float32)
    ref_out, ref_lse = reference(q, cpu_meta, kc, vc, 0.125, -1, 5.0)
    out, lse = sparse_attention(q.cuda(), meta, kc.cuda(), vc.cuda(), scale=0.125, logit_cap=5.0)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3])
def test_cuda_triton_inconsistent_metadata_gives_nan(splits):
    from samcache.ops import attention_triton

    q, meta, kc, vc = make_batch(8, [64], [4], 0, 16, 1, 2, 64, torch.float16)
    ref_out, _ = reference(q, meta, kc, vc, 64**-0.5, -1, 0.0)
    for bad, nan_rows, change in _bad_metadata_cases(meta, "cuda"):
        out, lse = attention_triton.paged_attention(q.cuda(), bad, kc.cuda(), vc.cuda(), scale=64**-0.5, window=-1,
                                                    logit_cap=0.0, config={"splits": splits})
        torch.cuda.synchronize()
        ok_rows = [r for r in range(q.shape[0]) if r not in nan_rows]
        assert out[nan_rows].isnan().all() and lse[nan_rows].isnan().all(), change
        torch.testing.assert_close(out[ok_rows].cpu().double(), ref_out[ok_rows], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_host_arrays_upload_in_one_copy(device):
    from samcache.ops.host_arrays import upload

    arrays = [np.array([3, 1, 2]), np.zeros(0, np.int64), [7], np.arange(5, dtype=np.int16)]
    got = upload(arrays, np.int32, device)
    assert [t.dtype for t in got] == [torch.int32] * 4 and all(t.device.type == device for t in got)
    assert [t.cpu().tolist() for t in got] == [[3, 1, 2], [], [7], [0, 1, 2, 3, 4]]
    assert all(t.is_contiguous() for t in got)
    assert upload([], np.int64, device) == []
    with pytest.raises(ValueError, match="must hold integers"):
        upload([np.array([0.5])], np.int32, device)
    with pytest.raises(ValueError, match="outside int32"):
        upload([np.array([2**40])], np.int32, device)
    with pytest.raises(ValueError, match="integer type"):
        upload([np.array([1])], np.float32, device)


def test_triton_launch_settings_are_checked(interpreted):
    q, meta, kc, vc = make_batch(5, [40], [3], 1, 16, 1, 2, 16, torch.float32)
    call = lambda **kw: interpreted.paged_attention(q, meta, kc, vc, scale=0.25, window=-1, logit_cap=0.0, **kw)  # noqa: E731
    for config, match in (({"block_k": 32}, "unknown Triton launch settings"), ({"splits": 0}, "must be an int >= 1"),
                          ({"block_n": 48}, "power of two"), ({"num_warps": 2.0}, "must be an int")):
        with pytest.raises(ValueError, match=match):
            call(config=config)
    with pytest.raises(ValueError, match="max_rows_per_seq"):
        call(max_rows_per_seq=-1)
    with pytest.raises(ValueError, match="q must be"):  # the op's own checks, as sparse_attention runs them
        interpreted.paged_attention(q[0], meta, kc, vc, scale=0.25, window=-1, logit_cap=0.0)
