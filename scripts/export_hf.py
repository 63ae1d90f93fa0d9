#!/usr/bin/env python
"""Export a nanotrain run or checkpoint as a Hugging Face Llama directory (transformers, vLLM, the Hub).

    python scripts/export_hf.py SRC OUT_DIR [--dtype bfloat16|float32] [--max-shard-size 5GB]

SRC: a run directory (its latest complete checkpoint), a checkpoints root, or one checkpoint
directory, saved at any (dp, tp, pp, cp, ZeRO stage). OUT_DIR then loads with
``LlamaForCausalLM.from_pretrained(OUT_DIR)`` and ``AutoTokenizer.from_pretrained(OUT_DIR)``.
The work is ``nanotrain.checkpoint.hf_export`` (streamed tensor by tensor; see its docstring).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.checkpoint.format import CheckpointError  # noqa: E402
from nanotrain.checkpoint.hf_export import DEFAULT_MAX_SHARD, export_hf, parse_size  # noqa: E402
from nanotrain.config.paths import CREATE_DIR, DIR, check_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="run directory, checkpoints root or checkpoint directory")
    parser.add_argument("out_dir", help="Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the written weights (default float32: the master weights, exact)")
    parser.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD),
                        help="split model.safetensors into index-sharded files above this size (default 5GB)")
    args = parser.parse_args(argv)
    try:
        max_shard = parse_size(args.max_shard_size)
    except ValueError:
        print(f"error: --max-shard-size {args.max_shard_size!r}: a size like 5GB, 500MB or 20KB", file=sys.stderr)
        return 2
    if max_shard <= 0:
        print("error: --max-shard-size must be positive", file=sys.stderr)
        return 2
    try:
        check_path("SRC", args.src, DIR, CheckpointError)
        check_path("OUT_DIR", args.out_dir, CREATE_DIR, CheckpointError)
        result = export_hf(args.src, args.out_dir, args.dtype, max_shard)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {result['checkpoint']} -> {args.out_dir}: {len(result['files'])} weight file(s), "
          f"{result['bytes'] / 1e6:.1f} MB {args.dtype}, {result['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
