"""The engine's CPU paths against what they replace, measured in the same run.

1. Linear layers: ``samcache.engine.linear.linear`` (oneDNN for 8+ rows) against torch's
   ``F.linear`` (MKL sgemm) at the shapes of a GUI turn on the `small` preset (prefill rows, fused
   q/k/v and gate/up, decode rows of one and eight sessions).
2. The vision tower on one 1280x720 screenshot: under ``fast_vision`` (oneDNN linears, long
   attention through samcache's kernel) against transformers' own modules (MKL, SDPA), and the
   largest difference between their outputs.

    python bench/bench_cpu_paths.py --threads 1
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

from samcache.engine.linear import linear

from timing import best_seconds  # bench/timing.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", help="checkpoint (default: build the small preset)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"CPU paths, float32, {torch.get_num_threads()} thread(s)\n")
    print("| linear (rows x in -> out) | F.linear (MKL) | samcache linear | speed-up | max difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for rows, k, n, what in ((1446, 256, 512, "q/k/v of a samcache turn"), (1446, 256, 1536, "gate/up"),
                             (4844, 256, 1536, "gate/up of a full prefill"), (1446, 768, 256, "down"),
                             (8, 256, 1536, "gate/up, 8 decode rows"), (1, 256, 1536, "gate/up, one decode row")):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        t_ref = best_seconds(lambda: torch.nn.functional.linear(x, w), "cpu", 20)
        t_ours = best_seconds(lambda: linear(x, w), "cpu", 20)
        diff = (linear(x, w) - torch.nn.functional.linear(x, w)).abs().max().item()
        print(f"| {rows} x {k} -> {n} ({what}) | {t_ref * 1e3:.3f} ms | {t_ours * 1e3:.3f} ms | "
              f"{t_ref / t_ours:.2f}x | {diff:.1e} |")

    import numpy as np

    from samcache.engine import SAMcacheEngine
    from samcache.random_checkpoints import build_preset

    model = args.model or build_preset("qwen2_5_vl", "small", pathlib.Path(tempfile.mkdtemp()) / "small")
    engine = SAMcacheEngine(model, device="cpu", kv_cache_bytes=1 << 20, keep_image_order=False)
    image = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), dtype=np.uint8)
    inputs = engine.processor.image_processor(images=[image], return_tensors="pt", input_data_format="channels_last")
    r = engine.runner
    with torch.no_grad():
        reference = lambda: r.model.model.get_image_features(  # noqa: E731
            inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True).pooler_output[0]
        t_ref = best_seconds(reference, "cpu", 5)
        t_ours = best_seconds(lambda: r.encode_images(inputs["pixel_values"], inputs["image_grid_thw"]), "cpu", 5)
        diff = (reference() - r.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])[0][0]).abs().max().item()
    print(f"\nvision tower, one 1280x720 screenshot ({int(inputs['image_grid_thw'].prod())} patches): transformers' "
          f"modules {t_ref * 1e3:.1f} ms, fast_vision {t_ours * 1e3:.1f} ms ({t_ref / t_ours:.2f}x), "
          f"max difference {diff:.1e}")


if __name__ == "__main__":
    main()
