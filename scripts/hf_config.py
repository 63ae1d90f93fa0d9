#!/usr/bin/env python
"""Print the ``model:`` YAML section of a nanotrain config for a local Hugging Face Llama directory.

    python scripts/hf_config.py PATH >> my_run.yaml     # then set checkpoints.init_from_hf: PATH

Reads config.json only (no torch); refuses, with one ``error:`` line each, what nanotrain's Llama
cannot compute (another architecture, rope scaling, biases, sliding windows).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.checkpoint.hf_dir import HFError, open_hf_dir  # noqa: E402
from nanotrain.config.paths import DIR, check_path  # noqa: E402
from nanotrain.models import hf_llama  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="Hugging Face model directory (config.json + *.safetensors)")
    args = parser.parse_args(argv)
    try:
        check_path("PATH", args.path, DIR, HFError)
        hf = open_hf_dir(args.path)
        problems = hf_llama.unsupported(hf.config)
        if problems:
            raise HFError("\nerror: ".join(f"{args.path}: {p}" for p in problems))
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# from {Path(args.path).resolve()}/config.json")
    print(hf_llama.model_yaml(hf.config), end="")
    print(f"checkpoints:\n  init_from_hf: {Path(args.path).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
