"""Fixtures of the vLLM plugin's end-to-end tests (run in vLLM's environment)."""

import os

import pytest


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """vLLM offline, its caches and sockets in a folder of the module's own, the engine core in the
    test's process (VLLM_ENABLE_V1_MULTIPROCESSING=0); the environment restored afterwards."""
    root = tmp_path_factory.mktemp("vllm-plugin")
    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                      VLLM_CACHE_ROOT=str(root / "cache"), XDG_CACHE_HOME=str(root / "cache"),
                      VLLM_RPC_BASE_PATH=str(root), VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    yield root
    os.environ.clear()
    os.environ.update(saved)
