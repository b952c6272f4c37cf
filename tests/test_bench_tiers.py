"""bench/bench_tiers.py runs end to end on a small trace and reports what the docs quote: hits per
tier, cold bytes against fp16, and two instances over one Mooncake store with a warm single
instance's reuse (timings are the benchmark's business, not asserted here)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
from needs import need_module  # noqa: E402

need_module("mooncake.store", "make test installs mooncake-transfer-engine-non-cuda (and Debian's libibverbs1)")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_tiers_reports_hits_bytes_and_shared_reuse(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_tiers.py"), "--pages", "6", "--turns", "6", "--per-turn", "2",
           "--device-pages", "2", "--warm-turns", "1", "--fidelity-every", "3", "--threads", "1",
           "--configs", "device-only,+host,+disk-fp8", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    runs = {r["config"]: r for r in res["configs"]}
    assert runs["+host"]["hit_rate"] > runs["device-only"]["hit_rate"]
    assert runs["+host"]["hit_rate_by_tier"]["host"] > 0 and runs["+disk-fp8"]["hit_rate_by_tier"]["disk"] > 0
    disk = runs["+disk-fp8"]
    assert disk["smaller_than_fp16"] > 1 and disk["fp32_bytes"] == 2 * disk["fp16_bytes"]
    assert all(len(r["ttft_by_turn_s"]) == 6 and r["speedup_by_turn_median"] > 0 for r in res["configs"])
    shared = res["shared"]
    # One store between two instances gives them the reuse of one warm instance, exactly.
    assert shared["shared"]["prefilled_tokens"] == shared["single+host"]["prefilled_tokens"]
    assert shared["shared"]["prefilled_tokens"] < shared["alone"]["prefilled_tokens"]
    assert shared["shared"]["hit_rate_by_tier"]["remote"] > 0
