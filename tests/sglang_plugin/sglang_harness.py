"""Run SGLang's own model classes on CPU, through SGLang's real batch plumbing.

This is test support for the SGLang plugin tests. Everything that matters is
SGLang's real code: the model class (``sglang.srt.models.qwen2_5_vl``), its
config normalisation (``sglang.srt.configs.model_config.ModelConfig``), its
weight loader (``model.load_weights`` on checkpoint-named tensors), the
``ForwardBatch``, ``ReqToTokenPool``, ``MHATokenToKVPool``, ``RadixAttention``,
the ``torch_native`` attention backend, the multimodal plumbing
(``MultimodalDataItem`` / ``MultimodalInputs`` built the way the processors and
the scheduler build them, ``general_mm_embed_routine``) and M-RoPE
(``MRotaryEmbedding.get_rope_index``).

The only stand-ins are:

* ``_ModelRunnerShim``: the three attributes ``TorchNativeAttnBackend.__init__``
  reads (``device``, ``req_to_token_pool``, ``token_to_kv_pool``).
* a ``vllm._custom_ops`` module with a ``rotary_embedding`` that raises if
  called. On a host that is neither CUDA nor SGLang's CPU engine,
  ``RotaryEmbedding.__init__`` (``layers/rotary_embedding/base.py``) imports
  that kernel as the *fallback for forward_cuda*; it is never called on CPU,
  where ``BaseFusedOp`` dispatches to ``forward_native``. It is only installed
  when vllm itself is not importable.
* the row/slot bookkeeping a scheduler would do (which row of ``req_to_token``
  a request owns, which KV slots its tokens go to), done by ``Pools``.

Why not ``SGLANG_USE_CPU_ENGINE=1``: with it, ``mem_cache/memory_pool.py``
imports ``sgl_kernel`` (``copy_all_layer_kv_cache_cpu``) at import time, which is
not installed. Without it, all SGLang ops fall back to their pure-torch
``forward_native`` (``kernels/fused_op.py::_platform_key`` returns ``""``).

Typical use::

    setup_sglang()
    cfg = tiny_qwen2_5_vl_config()
    model = build_qwen2_5_vl(cfg, seed=0)
    pools = Pools.for_model(model)
    ids, items = prompt_with_images(cfg, [[1, 2, 3], (1, 8, 8), [4, 5]], seed=0)
    req = Request.create(model, pools, ids, items)
    out = run_batch(model, pools, [req.extend()])       # whole prompt
    out.next_token_logits                                # [1, vocab]
    out = run_batch(model, pools, [req.decode(7)], mode="decode")

Everything runs in float32 on CPU.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import types
from array import array
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

# ---------------------------------------------------------------------------
# 1. Process set-up
# ---------------------------------------------------------------------------

_SETUP_DONE = False
DEVICE = "cpu"
DTYPE = torch.float32


def _install_rotary_fallback_stub() -> None:
    """Satisfy ``from vllm._custom_ops import rotary_embedding`` (never called on CPU)."""
    try:
        import vllm._custom_ops  # noqa: F401

        return
    except Exception:
        pass

    def rotary_embedding(*args, **kwargs):  # pragma: no cover - must never run
        raise NotImplementedError(
            "sglang_harness: the vllm rotary_embedding CUDA fallback was called; "
            "the CPU path should use RotaryEmbedding.forward_native"
        )

    vllm_mod = types.ModuleType("vllm")
    ops_mod = types.ModuleType("vllm._custom_ops")
    ops_mod.rotary_embedding = rotary_embedding
    vllm_mod._custom_ops = ops_mod
    vllm_mod.__sglang_harness_stub__ = True
    sys.modules.setdefault("vllm", vllm_mod)
    sys.modules.setdefault("vllm._custom_ops", ops_mod)


def _install_torchvision_shim() -> None:
    """PyPI torchvision is a CUDA build; its op registrations fail on CPU torch.

    The env's .pth normally does this already; repeat it here so the harness
    also works when imported from a plain interpreter.
    """
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))


def setup_sglang(master_port: int | None = None) -> None:
    """Idempotent process set-up for running SGLang models on CPU (world size 1).

    Mirrors ``sglang.test.layer_ut_utils.init_single_process_dist`` plus
    ``sglang.test.test_utils.publish_build_topology`` (those modules cannot be
    imported here: ``test_utils`` pulls in ``datasets``):

    * gloo ``init_distributed_environment(world_size=1, rank=0)``;
    * ``runtime_context.publish(ServerArgs(model_path="dummy", tp/ep/pp=1,
      device="cpu"), role="test")`` so ``get_parallel()``, ``get_mm()``,
      ``get_server_args()`` ... answer;
    * ``initialize_model_parallel(backend="gloo")`` for the TP/PP/EP groups
      that ``ColumnParallelLinear`` & co. query even at tp=1.
    """
    global _SETUP_DONE
    if _SETUP_DONE and _context_published():
        return
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        raise RuntimeError(
            "sglang_harness needs SGLANG_USE_CPU_ENGINE unset: with it, "
            "sglang.srt.mem_cache.memory_pool imports sgl_kernel"
        )
    _install_torchvision_shim()
    _install_rotary_fallback_stub()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if master_port is None and "MASTER_PORT" not in os.environ:
        # A free rendezvous port of its own: two harness processes at once (the plugin tests and an
        # eval beside them) would otherwise collide on one fixed port.
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            master_port = free.getsockname()[1]
    if master_port is not None:
        os.environ.setdefault("MASTER_PORT", str(master_port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")

    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_parallel,
        publish,
        reset_context,
    )
    from sglang.srt.server_args import ServerArgs

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if model_parallel_is_initialized() and not _context_published():
        # Another test reset SGLang's runtime context (e.g. around its own published ServerArgs):
        # rebuild the groups so they are written into a fresh context again.
        parallel_state.destroy_model_parallel()
    if not model_parallel_is_initialized():
        reset_context()
        publish(
            ServerArgs(
                model_path="dummy",
                tp_size=1,
                ep_size=1,
                pp_size=1,
                device="cpu",
                attention_backend="torch_native",
                # The harness runs forwards without a prefix tree (the radix tests build their own):
                # nothing here could serve a splice's approximate KV as exact.
                disable_radix_cache=True,
            ),
            role="test",
            ranks=SpawnRanks(world_rank=0),
        )
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    reset_mm_embedding_cache()
    torch.set_default_dtype(DTYPE)
    _SETUP_DONE = True


def _context_published() -> bool:
    """Whether SGLang's runtime context still holds the groups this set-up wrote."""
    from sglang.srt.runtime_context import get_parallel

    try:
        get_parallel().pp_group
    except Exception:  # noqa: BLE001 - SGLang raises RuntimeError for a name not written
        return False
    return True


def reset_mm_embedding_cache(max_size_bytes: Optional[int] = None) -> None:
    """(Re)create SGLang's process-wide multimodal embedding cache
    (``mm_schedule.embedding_cache``, a ``MultiModalStaticCache`` keyed by item
    hash), as ``mem_cache/kv_cache_builder.py`` does at start-up with
    ``SGLANG_VLM_CACHE_SIZE_MB``. ``general_mm_embed_routine`` needs it; it also
    means a second forward over the same image hash reuses the cached ViT
    output (call this to force a fresh encode)."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.mm_schedule import init_mm_embedding_cache

    if max_size_bytes is None:
        max_size_bytes = envs.SGLANG_VLM_CACHE_SIZE_MB.get() * 1024 * 1024
    init_mm_embedding_cache(max_size_bytes)


# ---------------------------------------------------------------------------
# 2. Tiny configs and model construction
# ---------------------------------------------------------------------------

# Token ids inside the tiny vocab (512). Text tokens should stay below TEXT_VOCAB.
TINY_VOCAB = 512
TEXT_VOCAB = 480
IMAGE_TOKEN_ID = 500
VIDEO_TOKEN_ID = 501
VISION_START_TOKEN_ID = 502
VISION_END_TOKEN_ID = 503
BOS_TOKEN_ID = 510
EOS_TOKEN_ID = 511


def tiny_qwen2_5_vl_config(**overrides):
    """A transformers ``Qwen2_5_VLConfig`` small enough for second-scale CPU tests.

    Text: hidden 128, 2 layers, 4 q heads / 2 kv heads (GQA), head_dim 32,
    mrope_section [4, 6, 6] (sums to head_dim/2), vocab 512.
    Vision: depth 2, hidden 64, 2 heads, patch 14, temporal patch 2, spatial
    merge 2, window 56 (2x2 merged-token windows), full attention in block 1,
    out_hidden_size 128.

    ``overrides``: top-level keys, or ``text_config={...}`` /
    ``vision_config={...}`` dicts that are merged into the defaults.
    """
    from transformers import Qwen2_5_VLConfig

    text = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [4, 6, 6],
            "rope_theta": 1000000.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        initializer_range=0.05,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
        initializer_range=0.05,
    )
    return _vl_config(Qwen2_5_VLConfig, text, vision, overrides)


def _vl_config(config_cls, text: dict, vision: dict, overrides: dict):
    """``config_cls`` with the tiny vocabulary's special tokens, ``text`` / ``vision`` defaults
    merged with ``overrides``' ``text_config`` / ``vision_config``, other overrides top-level."""
    text.update(overrides.pop("text_config", {}) or {})
    vision.update(overrides.pop("vision_config", {}) or {})
    top = dict(
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        tie_word_embeddings=False,
        architectures=[config_cls.__name__.replace("Config", "ForConditionalGeneration")],
    )
    top.update(overrides)
    return config_cls(text_config=text, vision_config=vision, **top)


def sglang_model_config(hf_config):
    """SGLang's own ``ModelConfig`` for ``hf_config`` (saved to a temp dir and
    re-read through ``sglang.srt.utils.hf_transformers.get_config``, which
    lifts text-config attributes to the top level and normalises rope_scaling,
    exactly as for a real checkpoint)."""
    setup_sglang()
    from sglang.srt.configs.model_config import ModelConfig

    path = tempfile.mkdtemp(prefix="sglang_harness_cfg_")
    hf_config.save_pretrained(path)
    return ModelConfig(model_path=path, trust_remote_code=False, dtype="float32")


def _hf_checkpoint_name(name: str) -> str:
    """transformers>=4.52 names -> the original Qwen2.5-VL checkpoint names that
    SGLang's ``load_weights`` expects (``model.layers.*``, ``visual.*``, ``lm_head.*``)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    return name


def hf_reference_qwen2_5_vl(config, seed: int = 0):
    """The transformers ``Qwen2_5_VLForConditionalGeneration`` whose weights
    ``build_qwen2_5_vl(config, seed)`` loads (same seed -> identical weights).
    Useful as an independent reference implementation."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = transformers.Qwen2_5_VLForConditionalGeneration(config)
    return hf.eval().to(DTYPE)


def build_qwen2_5_vl(config, seed: int = 0):
    """SGLang's ``Qwen2_5_VLForConditionalGeneration`` with deterministic random weights.

    Weights: a transformers model is initialised under ``torch.manual_seed(seed)``
    (inside ``fork_rng``; the global RNG is untouched), its state dict renamed to
    checkpoint names and fed through SGLang's own ``model.load_weights`` (so the
    stacked qkv / gate_up shard loaders run for real). Every SGLang parameter is
    NaN-filled first and checked afterwards, so none can stay uninitialised.
    Then ``post_load_weights`` / ``process_weights_after_loading`` run as in
    SGLang's loaders. The SGLang ``ModelConfig`` is attached as
    ``model.sglang_model_config``.
    """
    setup_sglang()
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    return _build_from_hf(Qwen2_5_VLForConditionalGeneration, config, seed, hf_reference_qwen2_5_vl)


def tiny_qwen3_vl_moe_config(**overrides):
    """A tiny transformers ``Qwen3VLMoeConfig``: text hidden 128, 3 layers,
    4 q / 2 kv heads, head_dim 32, interleaved mrope_section [4, 6, 6], 4
    experts (top-2, moe_intermediate 32), vocab 512; vision depth 3, hidden
    64, patch 16, merge 2, deepstack_visual_indexes [0, 1, 2].

    Three deepstack indexes because SGLang's ``Qwen3MoeLLMModel`` hard-codes
    ``deepstack_embed_to_decoder_layer = range(3)`` (qwen3_vl_moe.py): with
    fewer it slices an empty deepstack chunk and fails in
    ``residual_batch.add_to_output`` ("size of tensor a (128) must match the
    size of tensor b (0)").
    """
    from transformers import Qwen3VLMoeConfig

    text = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        initializer_range=0.05,
    )
    vision = dict(
        depth=3,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=128,
        num_position_embeddings=256,
        deepstack_visual_indexes=[0, 1, 2],
        initializer_range=0.05,
    )
    return _vl_config(Qwen3VLMoeConfig, text, vision, overrides)


class _CheckpointLayoutState:
    """transformers 5 keeps fused experts as gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]; released Qwen3-VL-MoE checkpoints (what SGLang's
    ``load_fused_expert_weights`` transposes) store [E, H, 2I] / [E, I, H]."""

    def __init__(self, hf_model):
        self.hf_model = hf_model

    def state_dict(self):
        out = {}
        for k, v in self.hf_model.state_dict().items():
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                v = v.transpose(-1, -2).contiguous()
            out[k] = v
        return out


def hf_reference_qwen3_vl_moe(config, seed: int = 0):
    """transformers ``Qwen3VLMoeForConditionalGeneration`` with the weights
    ``build_qwen3_vl_moe(config, seed)`` loads."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = transformers.Qwen3VLMoeForConditionalGeneration(config)
    return hf.eval().to(DTYPE)


def build_qwen3_vl_moe(config, seed: int = 0):
    """SGLang's ``Qwen3VLMoeForConditionalGeneration`` with deterministic random
    weights, loaded as in ``build_qwen2_5_vl`` (fused experts in checkpoint layout)."""
    setup_sglang()
    from sglang.srt.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

    return _build_from_hf(
        Qwen3VLMoeForConditionalGeneration,
        config,
        seed,
        lambda c, s: _CheckpointLayoutState(hf_reference_qwen3_vl_moe(c, s)),
    )


def _build_from_hf(model_cls, config, seed, hf_builder):
    from sglang.srt.model_loader.loader import post_load_weights

    mc = sglang_model_config(config)
    with torch.device(DEVICE):
        model = model_cls(config=mc.hf_config, quant_config=None)
    model = model.to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    state = hf_builder(config, seed).state_dict()
    model.load_weights((_hf_checkpoint_name(k), v.to(DTYPE)) for k, v in state.items())
    missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise RuntimeError(f"weights not loaded by SGLang's load_weights: {missing}")
    post_load_weights(model)
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(module)
    model.sglang_model_config = mc
    return model.eval()


def full_config_of(model):
    """The whole (vision + text) SGLang-normalised HF config of ``model``
    (some SGLang VLM classes keep only the text config in ``model.config``)."""
    mc = getattr(model, "sglang_model_config", None)
    return mc.hf_config if mc is not None else model.config


def text_config_of(model):
    """The (SGLang-normalised) config that holds the language-model shapes."""
    cfg = full_config_of(model)
    return getattr(cfg, "text_config", None) or cfg


def kv_shape_of(model) -> Tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the language model."""
    mc = getattr(model, "sglang_model_config", None)
    if mc is not None:
        return mc.num_hidden_layers, mc.get_num_kv_heads(1), mc.head_dim
    tc = text_config_of(model)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return tc.num_hidden_layers, tc.num_key_value_heads, head_dim


# ---------------------------------------------------------------------------
# 3. Pools, slot allocation and the model-runner shim
# ---------------------------------------------------------------------------


class _ModelRunnerShim:
    """What ``TorchNativeAttnBackend.__init__`` reads from a ModelRunner."""

    def __init__(self, device, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool


class Pools:
    """Real ``ReqToTokenPool`` + ``MHATokenToKVPool`` (page_size 1) + backend.

    * ``req_to_token_pool``: rows 1..max_reqs (row 0 is SGLang's padding row).
    * ``token_to_kv_pool``: slots 1..num_slots (slot 0 is SGLang's dummy slot).
    * ``attn_backend``: ``TorchNativeAttnBackend`` over the two pools (or
      whatever ``backend_factory(model_runner)`` returns).
    * ``alloc_row()/free_row(row)``, ``alloc_slots(n)/free_slots(slots)``: the
      scheduler-side bookkeeping (plain free lists).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_slots: int = 4096,
        max_reqs: int = 16,
        max_context_len: int = 2048,
        dtype: torch.dtype = DTYPE,
        backend_factory=None,
    ):
        setup_sglang()
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.device = DEVICE
        self.req_to_token_pool = ReqToTokenPool(
            size=max_reqs,
            max_context_len=max_context_len,
            device=DEVICE,
            enable_memory_saver=False,
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            size=num_slots,
            page_size=1,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=num_layers,
            device=DEVICE,
            enable_memory_saver=False,
        )
        self.model_runner = _ModelRunnerShim(DEVICE, self.req_to_token_pool, self.token_to_kv_pool)
        factory = backend_factory or TorchNativeAttnBackend
        self.attn_backend = factory(self.model_runner)
        self._free_rows = list(self.req_to_token_pool.free_slots)
        self._free_slots = list(range(1, num_slots + 1))

    @classmethod
    def for_model(cls, model, **kwargs) -> "Pools":
        """Pools shaped for ``model``'s language model (layers, kv heads, head dim)."""
        layers, kv_heads, head_dim = kv_shape_of(model)
        return cls(layers, kv_heads, head_dim, **kwargs)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def alloc_row(self) -> int:
        return self._free_rows.pop(0)

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def alloc_slots(self, n: int) -> torch.Tensor:
        if n > len(self._free_slots):
            raise RuntimeError("sglang_harness.Pools: out of KV slots")
        out, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free_slots(self, slots) -> None:
        self._free_slots.extend(int(s) for s in torch.as_tensor(slots).flatten())

    def copy_prefix(self, src_row: int, dst_row: int, n: int) -> None:
        """Point ``dst_row``'s first ``n`` tokens at ``src_row``'s KV slots
        (what a radix-cache prefix hit does)."""
        self.req_to_token[dst_row, :n] = self.req_to_token[src_row, :n]


# ---------------------------------------------------------------------------
# 4. Prompts, multimodal inputs, M-RoPE
# ---------------------------------------------------------------------------


def num_image_tokens(grid_thw: Sequence[int], spatial_merge_size: int = 2) -> int:
    t, h, w = grid_thw
    return t * h * w // (spatial_merge_size**2)


def random_pixel_values(config, grid_thw: Sequence[int], seed: int = 0) -> torch.Tensor:
    """Random ``pixel_values`` [t*h*w, C*temporal_patch*patch*patch] for one image."""
    vc = config.vision_config
    t, h, w = grid_thw
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t * h * w, dim, generator=g, dtype=DTYPE)


def prompt_with_images(config, parts, seed: int = 0):
    """Build a prompt from ``parts``: lists of text token ids, and image grids
    ``(t, h, w)`` (patch units, before merge). Each image becomes
    ``<vision_start> <image_token>*n <vision_end>`` with n = t*h*w/merge^2, and
    a ``MultimodalDataItem`` (modality IMAGE, ``feature``=random pixel_values,
    ``image_grid_thw``=[[t,h,w]], ``offsets``=[(first, last)] of its image
    tokens, as ``BaseMultimodalProcessor.get_mm_items_offset`` computes them).
    Image k uses pixel seed ``seed + k``. Returns ``(input_ids, mm_items)``.
    """
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    merge = config.vision_config.spatial_merge_size
    ids: List[int] = []
    items = []
    for part in parts:
        if isinstance(part, tuple):
            n = num_image_tokens(part, merge)
            ids.append(config.vision_start_token_id)
            start = len(ids)
            ids.extend([config.image_token_id] * n)
            end = len(ids) - 1
            ids.append(config.vision_end_token_id)
            item = MultimodalDataItem(
                modality=Modality.IMAGE,
                offsets=[(start, end)],
                feature=random_pixel_values(config, part, seed + len(items)),
            )
            item.set("image_grid_thw", torch.tensor([list(part)], dtype=torch.int64))
            items.append(item)
        else:
            ids.extend(int(x) for x in part)
    return ids, items


def mrope_positions_for(input_ids, grid_thws, config):
    """M-RoPE positions as SGLang's processors compute them
    (``MRotaryEmbedding.get_rope_index``). Returns ``(positions [3, n] int64,
    mrope_position_delta [1, 1])``; for a token at index p >= n (generated
    text) the position on all three axes is ``p + delta``."""
    from sglang.srt.layers.rotary_embedding import MRotaryEmbedding

    vc = config.vision_config
    ids = torch.as_tensor(list(input_ids), dtype=torch.int64).unsqueeze(0)
    grid = (
        torch.as_tensor([list(g) for g in grid_thws], dtype=torch.int64)
        if grid_thws
        else None
    )
    positions, delta = MRotaryEmbedding.get_rope_index(
        spatial_merge_size=vc.spatial_merge_size,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        model_type=config.model_type,
        tokens_per_second=getattr(vc, "tokens_per_second", None),
        input_ids=ids,
        image_grid_thw=grid,
    )
    return positions.squeeze(1).to(torch.int64), torch.as_tensor(delta).reshape(1, 1)


def make_mm_inputs(config, input_ids, mm_items):
    """SGLang ``MultimodalInputs`` for a whole prompt, built the way the Qwen-VL
    processor + ``MultimodalInputs.from_processor_output`` build it: hash and
    ``pad_value`` from ``MultimodalDataItem.set_pad_value`` (content hash of the
    feature), ``im_token_id``, ``mrope_positions`` and ``mrope_position_delta``."""
    from sglang.srt.managers.schedule_batch import (
        MultimodalInputs,
        MultimodalProcessorOutput,
    )

    grids = [it.image_grid_thw[0].tolist() for it in mm_items if it.is_image()]
    positions, delta = mrope_positions_for(input_ids, grids, config)
    out = MultimodalProcessorOutput(
        mm_items=list(mm_items),
        input_ids=list(input_ids),
        im_token_id=config.image_token_id,
        im_start_id=config.vision_start_token_id,
        im_end_id=config.vision_end_token_id,
        video_token_id=config.video_token_id,
        mrope_positions=positions,
        mrope_position_delta=delta,
    )
    return MultimodalInputs.from_processor_output(out)


@dataclass
class ReqStep:
    """One request's share of a forward batch (low-level form).

    ``row``: the request's row in ``req_to_token``; ``prefix_len``: tokens of it
    already in the KV cache (their slots must already be in the row);
    ``input_ids``: the new tokens (image tokens already replaced by pad values,
    as the scheduler feeds them); ``mrope_positions``: [3, n] for the new
    tokens; ``mm_inputs``: the request's whole-prompt ``MultimodalInputs`` (the
    offsets are relative to the whole prompt, as in SGLang) or None.
    ``out_cache_loc``: KV slots for the new tokens (allocated if None).
    """

    row: int
    prefix_len: int
    input_ids: List[int]
    mrope_positions: Optional[torch.Tensor] = None
    mm_inputs: object = None
    out_cache_loc: Optional[torch.Tensor] = None


@dataclass
class Request:
    """A request's state across forward calls (what a scheduler ``Req`` keeps).

    ``origin_ids``: the unpadded token ids so far; ``padded_ids``: the same
    with image tokens replaced by ``pad_value`` via the model's own
    ``pad_input_ids``; ``kv_len``: tokens already in the KV cache; ``row``: its
    ``req_to_token`` row. ``prompt_len``: length of the original prompt (the
    part that ``mm_inputs.mrope_positions`` covers).
    """

    model: object
    pools: Pools
    origin_ids: List[int]
    padded_ids: List[int]
    mm_inputs: object
    row: int
    prompt_len: int
    kv_len: int = 0

    @classmethod
    def create(cls, model, pools: Pools, input_ids, mm_items=None, row: Optional[int] = None):
        mm_inputs = make_mm_inputs(full_config_of(model), input_ids, mm_items) if mm_items else None
        ids = list(int(x) for x in input_ids)
        padded = ids
        if mm_inputs is not None:
            padded = list(model.pad_input_ids(array("q", ids), mm_inputs))
        return cls(
            model=model,
            pools=pools,
            origin_ids=ids,
            padded_ids=padded,
            mm_inputs=mm_inputs,
            row=pools.alloc_row() if row is None else row,
            prompt_len=len(ids),
        )

    def mrope_for(self, start: int, end: int) -> torch.Tensor:
        """[3, end-start] M-RoPE positions of tokens [start, end), as
        ``ForwardBatch._compute_mrope_positions_{extend,decode}`` derive them."""
        if self.mm_inputs is None:
            return torch.arange(start, end, dtype=torch.int64).unsqueeze(0).repeat(3, 1)
        pos = self.mm_inputs.mrope_positions
        cols = [pos[:, start : min(end, self.prompt_len)]]
        if end > self.prompt_len:
            delta = int(self.mm_inputs.mrope_position_delta.flatten()[0])
            tail = torch.arange(max(start, self.prompt_len), end, dtype=torch.int64) + delta
            cols.append(tail.unsqueeze(0).repeat(3, 1))
        return torch.cat(cols, dim=1).to(torch.int64)

    def extend(self, n: Optional[int] = None) -> ReqStep:
        """Step that feeds the next ``n`` known tokens (default: all not yet cached)."""
        start = self.kv_len
        end = len(self.origin_ids) if n is None else start + n
        assert start < end <= len(self.origin_ids), (start, end, len(self.origin_ids))
        step = ReqStep(
            row=self.row,
            prefix_len=start,
            input_ids=self.padded_ids[start:end],
            mrope_positions=self.mrope_for(start, end),
            mm_inputs=self.mm_inputs,
        )
        step._owner = self  # so run_batch can advance kv_len
        return step

    def decode(self, token_id: int) -> ReqStep:
        """Append one generated token and return the step that feeds it."""
        assert self.kv_len == len(self.origin_ids), "decode needs all known tokens cached"
        self.origin_ids.append(int(token_id))
        self.padded_ids.append(int(token_id))
        return self.extend(1)

    def release(self, free_kv: bool = True) -> None:
        if free_kv and self.kv_len:
            self.pools.free_slots(self.pools.req_to_token[self.row, : self.kv_len].to(torch.int64))
        self.pools.free_row(self.row)
        self.kv_len = 0


# ---------------------------------------------------------------------------
# 5. Running a batch
# ---------------------------------------------------------------------------


@dataclass
class ForwardOutput:
    """Result of ``run_batch``.

    ``next_token_logits``: [batch, vocab] from SGLang's ``LogitsProcessor``
    (last new token of each request). ``hidden_states``: [num_new_tokens,
    hidden] final-norm hidden states of every new token (SGLang's
    ``CaptureHiddenMode.FULL``). ``logits``: [num_new_tokens, vocab] =
    ``hidden_states @ lm_head.weight.T`` (what the LogitsProcessor computes for
    the last token). ``token_slices``: each request's rows in the two.
    """

    next_token_logits: torch.Tensor
    hidden_states: Optional[torch.Tensor]
    logits: Optional[torch.Tensor]
    token_slices: List[slice]
    forward_batch: object
    raw: object = None

    def request_logits(self, i: int) -> torch.Tensor:
        return self.logits[self.token_slices[i]]


_MODES = {"extend": "EXTEND", "decode": "DECODE", "mixed": "MIXED"}


def build_forward_batch(pools: Pools, steps: Sequence[ReqStep], mode: str = "extend", capture_full_hidden: bool = True):
    """Write the new tokens' KV slots into ``req_to_token`` and build SGLang's
    real ``ForwardBatch`` for ``steps`` (mode: "extend", "decode", "mixed").

    Fields set as ``ForwardBatch.init_new`` sets them for the torch_native
    backend: ``positions`` / ``extend_start_loc`` via SGLang's
    ``compute_position``; ``mrope_positions`` from the steps.
    """
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
        compute_position,
    )

    fmode = getattr(ForwardMode, _MODES[mode])
    if fmode == ForwardMode.DECODE:
        assert all(len(s.input_ids) == 1 for s in steps), "decode steps feed one token"
    r2t = pools.req_to_token
    out_locs = []
    for s in steps:
        n = len(s.input_ids)
        if s.out_cache_loc is None:
            s.out_cache_loc = pools.alloc_slots(n)
        assert s.out_cache_loc.numel() == n
        r2t[s.row, s.prefix_len : s.prefix_len + n] = s.out_cache_loc.to(r2t.dtype)
        out_locs.append(s.out_cache_loc.to(torch.int64))

    bs = len(steps)
    prefix = [s.prefix_len for s in steps]
    ext = [len(s.input_ids) for s in steps]
    seq = [p + e for p, e in zip(prefix, ext)]
    input_ids = torch.tensor([t for s in steps for t in s.input_ids], dtype=torch.int64)
    seq_lens = torch.tensor(seq, dtype=torch.int64)
    mm_inputs = [s.mm_inputs for s in steps]
    mrope = torch.cat(
        [
            (
                s.mrope_positions
                if s.mrope_positions is not None
                else torch.arange(p, p + e).unsqueeze(0).repeat(3, 1)
            )
            for s, p, e in zip(steps, prefix, ext)
        ],
        dim=1,
    ).to(torch.int64)

    fb = ForwardBatch(
        forward_mode=fmode,
        batch_size=bs,
        input_ids=input_ids,
        req_pool_indices=torch.tensor([s.row for s in steps], dtype=torch.int64),
        seq_lens=seq_lens,
        out_cache_loc=torch.cat(out_locs),
        seq_lens_sum=sum(seq),
        seq_lens_cpu=seq_lens.clone(),
        req_pool_indices_cpu=torch.tensor([s.row for s in steps], dtype=torch.int64),
        return_logprob=False,
        capture_hidden_mode=CaptureHiddenMode.FULL if capture_full_hidden else CaptureHiddenMode.NULL,
        mm_inputs=mm_inputs if any(m is not None for m in mm_inputs) else None,
        mrope_positions=mrope,
        global_num_token_non_padded_cpu=int(input_ids.numel()),
    )
    if fmode == ForwardMode.DECODE:
        fb.positions = (seq_lens - 1).to(torch.int64)
    else:
        fb.extend_seq_lens = torch.tensor(ext, dtype=torch.int32)
        fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        fb.extend_seq_lens_cpu = list(ext)
        fb.extend_prefix_lens_cpu = list(prefix)
        fb.extend_num_tokens = int(sum(ext))
        fb.extend_logprob_start_lens_cpu = list(ext)
        fb.positions, fb.extend_start_loc = compute_position(
            "torch_native", fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_num_tokens
        )
    return fb


def run_batch(
    model,
    pools: Pools,
    steps: Sequence[ReqStep],
    mode: str = "extend",
    capture_full_hidden: bool = True,
    after_init=None,
) -> ForwardOutput:
    """Run ``model.forward(input_ids, positions, forward_batch)`` for ``steps``
    through ``pools.attn_backend`` (``init_forward_metadata`` first, then the
    forward inside ``forward_context(ForwardContext(attn_backend=...))``).
    Advances ``kv_len`` of the ``Request`` objects the steps came from. ``after_init(fb)`` runs
    where SGLang's ``ForwardBatch.init_new`` hooks run (e.g. the plugin's batch hook)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fb = build_forward_batch(pools, steps, mode, capture_full_hidden)
    if after_init is not None:
        fb = after_init(fb)
    backend = pools.attn_backend
    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        out = model.forward(fb.input_ids.clone(), fb.positions, fb)
    for s in steps:
        owner = getattr(s, "_owner", None)
        if owner is not None:
            owner.kv_len = s.prefix_len + len(s.input_ids)
    hidden = getattr(out, "hidden_states", None)
    logits = None
    if hidden is not None:
        lm_head = model.lm_head
        logits = hidden.to(DTYPE) @ lm_head.weight.to(DTYPE).T
        vocab = text_config_of(model).vocab_size
        logits = logits[:, :vocab]
    slices, start = [], 0
    for s in steps:
        slices.append(slice(start, start + len(s.input_ids)))
        start += len(s.input_ids)
    return ForwardOutput(
        next_token_logits=out.next_token_logits,
        hidden_states=hidden,
        logits=logits,
        token_slices=slices,
        forward_batch=fb,
        raw=out,
    )
