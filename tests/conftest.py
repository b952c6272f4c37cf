import os
import threading

import pytest
from hypothesis import HealthCheck, settings

import samcache

# Without a GPU, samcache's Triton kernels run in Triton's interpreter (tests/test_ops_attention_paths.py);
# Triton reads this when it is first imported, so it is set before any test module loads.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the "ci" profile (set by .ci/run through make test); both stay within seconds per test.
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SAMCACHE_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    import torch

    # The longest modules first: pytest-xdist hands out files in this order, and a long one handed
    # out last would run alone at the end.
    items.sort(key=lambda item: "long" not in item.keywords)
    if torch.cuda.is_available() and samcache._C.with_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of samcache")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_threads():
    """run_threads(worker, n): run worker(seed) in n threads at once; re-raise any failure."""

    def run(worker, n=4):
        errors = []

        def guarded(seed):
            try:
                worker(seed)
            except Exception as e:  # noqa: BLE001 - re-raised below in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

    return run


@pytest.fixture
def rejects_without_writing():
    """rejects_without_writing(call, exc, tensors, match=None): call() raises exc (its message
    matching ``match``) and leaves tensors as they were."""

    def check(call, exc, tensors, message="a rejected call must not write", match=None):
        before = [t.clone() for t in tensors]
        with pytest.raises(exc, match=match):
            call()
        assert all(t.equal(b) for t, b in zip(tensors, before)), message

    return check


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """One tiny random-weight checkpoint per family, built once for the whole run."""
    pytest.importorskip("transformers")
    from samcache.random_checkpoints import FAMILIES, build_tiny_model

    return {f: build_tiny_model(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def vllm_python():
    """vLLM's environment's Python (`make vllm-env`); where SAMCACHE_REQUIRE_PEERS=1 (make test) a
    missing one fails instead of skipping."""
    from samcache.bench.peers.vllm_launcher import PeerUnavailable, find_vllm_python

    try:
        return str(find_vllm_python())
    except PeerUnavailable as e:
        if os.environ.get("SAMCACHE_REQUIRE_PEERS") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))
