"""``python -m samcache.random_checkpoints FAMILY OUT_DIR [--seed N] [--set key=value ...]``: build and describe."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from samcache.random_checkpoints import FAMILIES, build_tiny_model, describe

    parser = argparse.ArgumentParser(
        prog="python -m samcache.random_checkpoints",
        description="Build a tiny random-weight Qwen-VL checkpoint (config, safetensors, tokenizer, processor).",
    )
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help='override a config field, value as JSON (e.g. --set num_hidden_layers=4 --set \'vision_config={"depth":3}\')',
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set needs KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        path = build_tiny_model(args.family, args.out_dir, seed=args.seed, **overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = describe(path)
    print(f"built {info['architecture']} ({args.family}, seed {args.seed}) in {info['path']}")
    print(f"  {info['params']:,} parameters, {info['bytes']:,} bytes on disk")
    print(f"  text:   {json.dumps(info['text'])}")
    print(f"  vision: {json.dumps(info['vision'])}")
    print(f"  tokens: {json.dumps(info['token_ids'])}")
    print(f"  files:  {', '.join(info['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
