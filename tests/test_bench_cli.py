"""`samcache bench` / `samcache report`: every mode on a 3-turn trace, the report, bad input."""

import json
import pathlib
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from samcache.bench.benchmark import MODES, parse_modes, run_benchmark  # noqa: E402
from samcache.cli import main  # noqa: E402
from samcache.bench.report import write_report  # noqa: E402
from samcache.bench.workloads import make_trace  # noqa: E402

SMALL = ["--image-size", "112", "168"]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints["qwen2_5_vl"]


@pytest.fixture(scope="module")
def results(model):
    trace = make_trace("gui", turns=3, window=2, size=(112, 168), max_new_tokens=2)
    return run_benchmark(trace, model, modes=[m for m in MODES if not MODES[m].peer and not MODES[m].needs_compression],
                         recompute=[0.05, 0.5, 0.05],
                         fidelity_tokens=2, progress=False, command="test")


def test_every_mode_runs_a_three_turn_trace(results):
    names = [r["name"] for r in results["runs"]]
    assert names == ["baseline", "prefix", "samcache@0.05", "samcache@0.5", "ordered@0.05", "ordered@0.5",
                     "no-recompute", "head-only@0.05",
                     "head-only@0.5", "uniform-budget@0.05", "uniform-budget@0.5", "new-only"]
    by = {r["name"]: r for r in results["runs"]}
    for r in results["runs"]:
        assert len(r["turns"]) == 3 and r["summary"]["ttft_p50_ms"] > 0
    assert by["baseline"]["summary"]["vit_calls"] == results["trace"]["images_sent"] == 5
    assert by["prefix"]["summary"]["vit_calls"] == 3 and by["prefix"]["summary"]["image_reused_tokens"] == 0
    assert by["samcache@0.05"]["summary"]["image_reused_tokens"] > 0  # turn 3 moved screenshot 1 up
    assert by["no-recompute"]["summary"]["recomputed_tokens"] == 0
    assert by["samcache@0.5"]["summary"]["recomputed_tokens"] > by["samcache@0.05"]["summary"]["recomputed_tokens"]
    assert by["baseline"]["summary"]["fidelity"] is None
    # the floor serves only first-seen images: one ViT call and one image's tokens a turn, no reuse
    floor = by["new-only"]
    assert floor["summary"]["vit_calls"] == 3 and floor["summary"]["fidelity"] is None
    assert floor["summary"]["image_reused_tokens"] == 0
    assert all(f["prompt_tokens"] < p["prompt_tokens"] for f, p in zip(floor["turns"][1:], by["prefix"]["turns"][1:]))
    kl = [t["fidelity"]["kl"] for t in by["samcache@0.05"]["turns"]]
    # turn 0 reuses nothing, turn 1 the tail of a screenshot at its old position (exact), turn 2 one moved up
    assert kl[0] < 1e-12 and kl[1] < 1e-12 and 0 < kl[2] < 0.1
    # ordered: the screenshot that moved up is not reused at its new index, only its ViT output
    ordered = by["ordered@0.05"]["turns"]
    assert ordered[2]["image_reused_tokens"] == 0 and ordered[2]["fidelity"]["kl"] < 1e-12
    assert by["ordered@0.05"]["summary"]["vit_calls"] == by["prefix"]["summary"]["vit_calls"] == 3
    assert by["uniform-budget@0.05"]["budget"] == "uniform" and by["samcache@0.05"]["budget"] == "layer-aware"
    assert results["meta"]["sensitivity"] is not None
    # head-only never recomputes past the span heads (10% of each reused span), whatever the ratio
    heads_only = by["head-only@0.5"]["turns"]
    assert all(t["recomputed_tokens"] <= -(-t["image_reused_tokens"] // 10) + 1 for t in heads_only)
    assert by["samcache@0.5"]["summary"]["recomputed_tokens"] > by["head-only@0.5"]["summary"]["recomputed_tokens"]
    # every mode decoded the same number of tokens (end-of-turn ignored)
    assert {t["decode_tokens"] for r in results["runs"] for t in r["turns"]} == {2}


def test_summarize_from_known_records():
    from samcache.bench.benchmark import summarize

    def rec(ttft, **kw):
        base = dict(ttft_s=ttft, latency_s=2 * ttft, prompt_tokens=100, prefilled_tokens=40, prefix_reused_tokens=32,
                    image_reused_tokens=28, recomputed_tokens=4, recomputed_token_layers=6, images=2, vit_calls=1,
                    vit_hits=1, image_kv_hits=1, image_kv_misses=1, kv_bytes=2**20, kv_held_bytes=3 * 2**20,
                    decode_tokens_per_s=10.0, recompute_rates=[0.15, 0.07], fidelity=None)
        return {**base, **kw}

    s = summarize([rec(0.1), rec(0.2), rec(0.3, kv_held_bytes=5 * 2**20), rec(0.4)])
    assert s["ttft_p50_ms"] == pytest.approx(250.0) and s["ttft_p95_ms"] == pytest.approx(385.0)
    assert s["computed_tokens"] == 4 * 40 + 4 * 6 // 2  # recompute counted per layer: 6 token-layers / 2 layers
    assert s["prefix_hit_rate"] == pytest.approx(0.32) and s["vit_skipped_rate"] == pytest.approx(0.5)
    assert s["image_kv_hit_rate"] == pytest.approx(0.5) and s["peak_kv_mib"] == pytest.approx(5.0)
    assert s["fidelity"] is None
    off = summarize([rec(0.1, images=0, vit_calls=0, vit_hits=0, image_kv_hits=0, image_kv_misses=0)])
    assert off["vit_skipped_rate"] is None and off["image_kv_hit_rate"] is None


def test_report_builds_from_a_results_file(results, tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["report", str(tmp_path / "results.json")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## What was run" in text and "`samcache@0.05`" in text and "## Reproduce" in text
    row = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| `")}
    assert row["`samcache@0.5`"][2].strip() == "0.5" and row["`baseline`"][2].strip() == "-"
    assert row["`baseline`"][15].strip() == "- / - / -" and row["`prefix`"][15].strip().endswith("/ -")
    assert "exact" in row["`baseline`"][18] and "2 tokens a turn in every mode" in text
    assert "n/a" in row["`new-only`"][18] and "`new-only` is a floor" in text
    assert row["`prefix`"][7].strip() == "1.00× / 1.00×" and "With 3 turns, p95 is close to the slowest" in text
    mean = results["runs"][0]["summary"]["ttft_mean_ms"]
    assert row["`baseline`"][5].strip() == f"{mean:.1f} ms"
    for png in ("ttft_per_turn.png", "tokens_by_mode.png", "fidelity_vs_recompute.png"):
        assert (tmp_path / png).stat().st_size > 1000
    with pytest.raises(ValueError, match="missing"):
        write_report({"runs": []}, tmp_path)


def test_bench_cli_writes_results_and_report(model, tmp_path, capsys):
    rc = main(["bench", "--scenario", "chat", "--turns", "2", "--modes", "prefix,samcache", "--model", str(model),
               "--out", str(tmp_path), "--quiet", "--max-new-tokens", "2", *SMALL])
    assert rc == 0
    assert json.loads((tmp_path / "results.json").read_text())["trace"]["scenario"] == "chat"
    assert (tmp_path / "report.md").exists() and "vs prefix" in capsys.readouterr().out
    (tmp_path / "report.md").unlink()
    assert main(["report", str(tmp_path)]) == 0 and (tmp_path / "report.md").exists()  # a run's folder works too
    rc = main(["bench", "--scenario", "chat", "--turns", "1", "--modes", "prefix", "--model", str(model), "--out",
               str(tmp_path / "nf"), "--quiet", "--max-new-tokens", "1", "--no-fidelity", *SMALL])
    assert rc == 0 and "fidelity not measured: --no-fidelity" in capsys.readouterr().out
    assert "Fidelity was not measured in this run" in (tmp_path / "nf" / "report.md").read_text()


def test_repeat_takes_each_turns_median_over_fresh_plays(model):
    trace = make_trace("gui", turns=2, window=2, size=(112, 168), max_new_tokens=2)
    res = run_benchmark(trace, model, modes=["prefix", "samcache"], repeat=3, fidelity_tokens=2, progress=False)
    assert res["meta"]["repeat"] == 3
    for run in res["runs"]:
        for t in run["turns"]:
            assert len(t["ttft_reps_s"]) == 3 and t["ttft_s"] == sorted(t["ttft_reps_s"])[1]
        # every play starts cold: each did the work of a single play (warm engines would hit caches)
        assert [t["vit_calls"] for t in run["turns"]] == [1, 1]
        for t in run["turns"]:
            assert len(t["work_reps"]) == 3 and all(w == t["work_reps"][0] for w in t["work_reps"])
            assert t["work_reps"][0] == [t["prefilled_tokens"], t["prefix_reused_tokens"], t["image_reused_tokens"],
                                         t["vit_calls"]]
    assert res["runs"][1]["summary"]["fidelity"] is not None
    with pytest.raises(ValueError, match="repeat must be"):
        run_benchmark(trace, model, modes=["prefix"], repeat=0, progress=False)


def test_every_mode_holds_its_image_kv_inside_its_pool(model):
    trace = make_trace("gui", turns=3, window=2, size=(112, 168), max_new_tokens=2)
    res = run_benchmark(trace, model, modes=["prefix", "samcache"], kv_cache_bytes=8 << 20, fidelity=False,
                        calibrate=False, progress=False)
    by = {r["name"]: r for r in res["runs"]}
    assert by["prefix"]["kv_memory_bytes"] == by["samcache"]["kv_memory_bytes"] <= 8 << 20
    for r in res["runs"]:
        assert all(t["kv_held_bytes"] <= r["kv_memory_bytes"] for t in r["turns"])
    # 24-token images in 16-token blocks: each holds its 2 or 3 blocks, never a copy beside them. One
    # token's KV on the tiny model: K and V x 2 layers x 2 KV heads x 32 dims x 4 bytes = 1,024 bytes.
    per_token = [t["image_kv_bytes_per_token"] for t in by["samcache"]["turns"]]
    assert all(32 / 24 <= p / 1024 <= 48 / 24 for p in per_token)
    assert by["prefix"]["turns"][0]["image_kv_bytes_per_token"] is None
    assert by["samcache"]["summary"]["image_kv_bytes_per_token"] == max(per_token) > 0


def test_bench_builds_a_model_when_none_is_given_and_deletes_it(tmp_path, capsys):
    args = ["bench", "--scenario", "chat", "--turns", "1", "--modes", "prefix", "--out", str(tmp_path), "--quiet",
            "--max-new-tokens", "1", "--no-fidelity", *SMALL]
    assert main(args) == 0
    built = pathlib.Path(capsys.readouterr().err.split("checkpoint (tiny) in ")[1].split()[0])
    assert built.name == "qwen2_5_vl" and not built.parent.exists()
    assert main(args + ["--keep-model"]) == 0
    kept = pathlib.Path(capsys.readouterr().err.split("checkpoint (tiny) in ")[1].split()[0])
    assert (kept / "config.json").exists()
    shutil.rmtree(kept.parent)
    # The results name the checkpoint built in a temporary folder without this machine's path.
    written = (tmp_path / "results.json").read_text() + (tmp_path / "report.md").read_text()
    assert f"$TMPDIR/{kept.parent.name}/qwen2_5_vl" in written and str(kept.parent) not in written


def test_results_name_no_path_of_this_machine():
    from samcache.bench.report import portable

    results = {"model_path": "/scratch/tmpx/run/qwen2_5_vl", "runs": [{"python": "/home/u/repo/.venv/bin/python",
                                                                     "n": 3, "ok": ("/home/u/repo", "/elsewhere")}]}
    out = portable(results, roots=("/home/u/repo", "/scratch/tmpx"))
    assert out == {"model_path": "$TMPDIR/run/qwen2_5_vl",
                   "runs": [{"python": ".venv/bin/python", "n": 3, "ok": ("/home/u/repo", "/elsewhere")}]}
    # A checkout inside the temporary folder is the working folder, not a temporary one.
    assert portable("/scratch/tmpx/repo/bench/out", roots=("/scratch/tmpx/repo", "/scratch/tmpx")) == "bench/out"


def test_bench_refuses_unknown_modes_and_scenarios(model, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out (bench/out/SCENARIO) is checked before the other arguments
    assert main(["bench", "--scenario", "gui", "--modes", "prefix,turbo", "--model", str(model)]) == 2
    assert "unknown mode(s) turbo; choose from baseline, prefix, samcache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--scenario", "movies"])
    assert "invalid choice: 'movies'" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--recompute", "0.05,2", "--model", str(model)]) == 2
    assert "recompute ratios must be in [0, 1]" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--image-size", "0", "84", "--model", str(model)]) == 2
    assert "size must be (height, width)" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--device", "gpu", "--model", str(model), "--quiet",
                 "--turns", "1", *SMALL]) == 2
    assert "device must be" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--model", "/nonexistent"]) == 2
    assert main(["bench", "--scenario", "gui", "--modes", "prefix", "--recompute", "0.1", "--model", str(model)]) == 2
    assert "--recompute applies to the modes that recompute" in capsys.readouterr().err
    assert main(["bench", "--scenario", "branch", "--turns", "3", "--model", str(model)]) == 2
    assert "'branch' has no parameter 'turns'; its parameters: seed, branches" in capsys.readouterr().err
    assert main(["bench", "--scenario", "docs", "--param", "pages", "--model", str(model)]) == 2
    assert "--param needs KEY=VALUE" in capsys.readouterr().err
    assert main(["bench", "--scenario", "docs", "--param", "per_turn=9", "--model", str(model)]) == 2
    assert "per_turn (9) cannot exceed pages (6)" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--turns", "2", "--param", "turns=3", "--model", str(model)]) == 2
    assert "turns is set by --turns; not also by --param" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--param", "size=[56, 56]", "--image-size", "56", "84"]) == 2
    assert "size is set by --image-size" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--dtype", "int8"]) == 2  # refused before any build
    err = capsys.readouterr().err
    assert "--device/--dtype: dtype must be one of" in err and "checkpoint" not in err
    assert main(["bench", "--scenario", "gui", "--device", "tpu"]) == 2
    assert "device must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("samcache ")
    assert main(["bench", "--scenario", "gui", "--repeat", "0", "--model", str(model)]) == 2
    assert "--repeat must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--threads", "0", "--model", str(model)]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--scenario", "gui", "--modes", "prefix,vllm", "--vllm-python", "/nonexistent/python",
                 "--model", str(model), "--quiet", "--turns", "1", *SMALL]) == 2
    assert "vllm_python (--vllm-python) '/nonexistent/python' is not an executable Python" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--scenario", "gui", "--preset", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err
    if not torch.cuda.is_available():  # refused before any checkpoint is built for it
        assert main(["bench", "--scenario", "gui", "--device", "cuda", "--preset", "qwen2.5-vl-7b"]) == 2
        err = capsys.readouterr().err
        assert "torch sees no CUDA GPU (torch " in err and "checkpoint" not in err
    assert main(["report", "/nonexistent/results.json"]) == 2
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("")


def test_peer_launcher_checks_its_arguments_before_starting_vllm():
    from samcache.bench.peers.vllm_launcher import PeerUnavailable, find_vllm_python, run_trace

    turns = [[{"role": "user", "content": "hi"}]]
    for kw, match in ((dict(threads=0), "threads must be an int >= 1"), (dict(dtype="fp8"), "dtype must be one of"),
                      (dict(block_size=0), "block_size must be"), (dict(timeout_s=0), "timeout_s must be")):
        with pytest.raises(ValueError, match=match):
            run_trace(turns, "/model", **kw)
    with pytest.raises(ValueError, match="non-empty list of turns"):
        run_trace([], "/model")
    with pytest.raises(ValueError, match="role must be one of"):
        run_trace([[{"role": "robot", "content": "x"}]], "/model")
    with pytest.raises(PeerUnavailable, match="'' is not an executable Python"):
        find_vllm_python("")
    with pytest.raises(ValueError, match="model_path '/model' is not a checkpoint folder"):
        run_trace(turns, "/model")


def test_peer_launcher_hands_vllm_an_absolute_checkpoint_path(tmp_path, monkeypatch):
    from samcache.bench.peers.vllm_launcher import checkpoint_dir

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    # vLLM runs in a scratch folder: a relative path would be read there, or as a model-hub id.
    assert checkpoint_dir("ckpt") == str(tmp_path.resolve() / "ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="'empty' is not a checkpoint folder"):
        checkpoint_dir("empty")


def test_compression_sweep_runs_every_mode_per_keep_ratio(tiny_checkpoints, tmp_path):
    from samcache.bench.benchmark import parse_keeps

    trace = make_trace("gui", turns=3, window=2, size=(112, 168), max_new_tokens=2)
    res = run_benchmark(trace, tiny_checkpoints["qwen3_vl_moe"], modes=["baseline", "samcache"],
                        compression=[1.0, 0.5], fidelity_tokens=2, calibrate=False, progress=False)
    by = {r["name"]: r for r in res["runs"]}
    assert list(by) == ["baseline@keep1", "baseline@keep0.5", "samcache@keep1", "samcache@keep0.5"]
    assert by["baseline@keep1"]["summary"]["kv_rows_fraction"] == 1.0
    assert by["baseline@keep1"]["summary"]["fidelity"]["kl_median"] == 0.0  # keep 1 computes exactly the same
    assert by["baseline@keep0.5"]["summary"]["kv_rows_fraction"] < 1.0
    assert by["samcache@keep0.5"]["summary"]["image_kv_rows_fraction"] < 1.0
    assert [t["prefilled_tokens"] for t in by["samcache@keep0.5"]["turns"]] == \
        [t["prefilled_tokens"] for t in by["samcache@keep1"]["turns"]]  # the same reuse, compressed
    report = write_report(res, tmp_path).read_text()
    assert "### Visual-token compression" in report and "`samcache@keep0.5`" in report
    assert (tmp_path / "compression.png").exists()
    for bad in ("0", "1.5", "x", ""):
        with pytest.raises(ValueError, match="keep"):
            parse_keeps(bad)


def test_bench_refuses_compression_on_a_dense_family_before_building(capsys):
    assert main(["bench", "--scenario", "chat", "--compression", "0.5", "--quiet"]) == 2
    assert "needs an MoE model" in capsys.readouterr().err
    assert main(["bench", "--scenario", "chat", "--modes", "samcache,routing-relevance", "--quiet"]) == 2
    assert "routing-relevance need --compression" in capsys.readouterr().err
