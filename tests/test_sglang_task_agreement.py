"""bench/eval_sglang_plugin.py on one held-out gui trace of the trained checkpoint: SGLang's real
Qwen2.5-VL classes give samcache's engine's replies. Its own path gives the engine's full-prefill
replies; with the plugin, image KV reused at any index gives the engine's replies at the same
settings, including where those differ from the full prefill's (the reuse is really approximate
on this model, so agreeing with it is not agreeing with a full prefill)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from needs import need_file

pytestmark = [pytest.mark.long, pytest.mark.peers]

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "eval_sglang_plugin.py"
SGLANG_PYTHON = os.environ.get("SAMCACHE_SGLANG_PYTHON", str(ROOT / ".venv-sglang" / "bin" / "python"))


def _run(*args: str, out: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--sglang-python", SGLANG_PYTHON, *args],
                          capture_output=True, text=True, timeout=900)


def test_sglang_plugin_gives_the_engines_replies_on_the_trained_model(tmp_path):
    need_file(SGLANG_PYTHON, "`make sglang-plugin` builds SGLang's environment")
    run = _run("--traces", "1", "--threads", "1", out=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["turns_compared"] == 6 and result["method"] == "two-track" and result["recompute"] == 0.05
    assert result["sglang_stock_vs_engine_full_prefill"] == {"first_token": 1.0, "reply": 1.0}
    assert result["sglang_plugin_vs_engine_reuse"] == {"first_token": 1.0, "reply": 1.0}
    # On this trace the reuse changes replies (so the agreement above is with approximate
    # KV, not with a full prefill).
    assert result["engine_reuse_vs_engine_full_prefill"]["reply"] < 1.0
    # The plugin's path ran and did the engine's work: the same image tokens spliced and the same
    # (token, layer) pairs recomputed, from prefixes in the engine's 16-token blocks, some of them
    # ending inside an image (its tail spliced, its head from the prefix).
    assert result["image_reused_tokens"]["plugin"] == result["image_reused_tokens"]["engine"] > 0
    assert result["recomputed_token_layers"]["plugin"] == result["recomputed_token_layers"]["engine"] > 0
    assert result["turns_whose_prefix_ends_inside_an_image"] > 0
    assert all(t["sglang_plugin_prefix"] == t["sglang_stock_prefix"] for t in result["turns"])


@pytest.mark.parametrize("args, message", [
    (("--method", "deviation"), "recompute_method 'deviation' needs samcache's own forward"),
    (("--method", "blend"), "recompute_method 'blend' is not a recompute method"),
    (("--recompute", "1.5"), "recompute_ratio must be a number in [0, 1], got 1.5"),
    (("--traces", "0"), "--traces must be >= 1, got 0"),
    (("--page-size", "0"), "--page-size must be >= 1, got 0"),
])
def test_sglang_agreement_refuses_bad_settings_before_any_engine_runs(tmp_path, args, message):
    run = _run(*args, out=tmp_path / "out")
    assert run.returncode != 0 and message in run.stderr
    assert not (tmp_path / "out").exists()  # nothing ran
