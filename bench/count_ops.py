"""Torch ops dispatched in a reuse turn, per layer: the launch count's proxy on the CPU.

On a GPU every dispatched op of the layer loop is at least one kernel launch, and a reuse turn of
the 7B-size engine spends most of its time launching (docs/benchmark.md, "GPU"). This counts the
ops without a GPU: the agent has seen 4 screenshots; the next turn shows them in another order
behind a new system prompt (the engine's reuse path: spliced images, recomputed rows), and a
``TorchDispatchMode`` counts every op dispatched while the engine serves it, split into the work
before the forward step (prompt, plan, splicing), the forward itself (per decoder layer) and the
rest. It also counts the ops that read a tensor back into Python (``aten::_local_scalar_dense``:
``.item()``, ``.tolist()``, ``int(t)``) or whose output size depends on data (``nonzero`` and
kin): each is a host synchronisation on a GPU.

    python bench/count_ops.py --out bench/out/count-ops.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import warnings

from samcache.bench.op_count import OpCounter, forward_phase


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: build the random-weight --preset)")
    p.add_argument("--preset", default="small")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--image-size", type=int, nargs=2, default=(720, 1280), metavar=("H", "W"))
    p.add_argument("--recompute", type=float, default=0.05)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message
    from samcache.random_checkpoints import build_preset

    model = args.model or build_preset("qwen2_5_vl", args.preset, pathlib.Path(tempfile.mkdtemp()) / "model")
    engine = SAMcacheEngine(model, device="cpu", recompute_ratio=args.recompute, recompute_budget="uniform",
                            keep_image_order=False)  # random weights: reuse at any index, said explicitly
    images = [screenshot(100 + i, tuple(args.image_size)) for i in range(args.images)]

    def turn(system, shown):
        return engine.chat(messages=[{"role": "system", "content": system},
                                     user_message(shown, "Which button should be clicked next?")], max_new_tokens=1)

    counter = OpCounter("before forward")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        turn("You operate a computer.", images)  # every image seen once
        turn("Warm-up: the screenshots again.", images[1:] + images[:1])
        with forward_phase(engine, counter, after="after forward"), counter:
            r = turn("Step 7: the screenshots below are the latest, newest last.", images[::-1])
    layers = engine.runner.num_layers
    m = r.metrics
    phases = {}
    for phase, counts in counter.counts.items():
        phases[phase] = {"ops": sum(counts.values()), "syncing_ops": counter.syncing(phase),
                         "top": dict(counts.most_common(12))}
    fwd = phases.get("forward", {"ops": 0})
    result = {"model": str(args.model or f"random {args.preset}"), "layers": layers,
              "fused": {"norms": engine.runner.fused_norms, "rope_and_kv_write": engine.runner.fused_rope},
              "turn": {"prompt_tokens": m.prompt_tokens, "image_reused_tokens": m.image_reused_tokens,
                       "prefilled_tokens": m.prefilled_tokens, "recomputed_tokens": m.recomputed_tokens},
              "ops_per_layer_in_forward": fwd["ops"] / layers, "phases": phases}
    print(f"reuse turn: {m.prompt_tokens} prompt tokens, {m.image_reused_tokens} image tokens reused, "
          f"{m.recomputed_tokens} recomputed; {layers} layers")
    for phase, info in phases.items():
        syncs = sum(info["syncing_ops"].values())
        print(f"  {phase:15s} {info['ops']:6d} ops ({syncs} that read back or size by data: {info['syncing_ops']})")
    print(f"  ops per layer in the forward: {result['ops_per_layer_in_forward']:.1f}")
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
