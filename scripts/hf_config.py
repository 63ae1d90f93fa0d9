#!/usr/bin/env python
"""Print the ``model:`` YAML section of a nanotrain config for a local Hugging Face model directory.

    python scripts/hf_config.py PATH >> my_run.yaml     # then set checkpoints.init_from_hf: PATH

Any family nanotrain imports (llama, mistral, qwen2, qwen3, smollm3, mixtral, qwen3_moe: the
section's ``family`` is config.json's ``model_type``). Reads config.json only (no torch);
refuses, in one ``error:`` line naming each (exit status 2), another model_type (the supported
ones named) and what nanotrain cannot compute (rope scaling other than llama3, an o_proj or MLP
bias, a sliding window on some layers only, router jitter, an MoE layer pattern nanotrain's
``model.moe`` cannot give). A llama3 scaling (Llama 3.1-3.3) is printed as ``model.rope_scaling``,
experts as ``model.moe``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.config.cli_args import ArgParser, answer  # noqa: E402
from nanotrain.config.paths import DIR, check_path  # noqa: E402
from nanotrain.hf.directory import HFError, hf_family, open_hf_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``; module doc); returns 0, or 2 for a wrong
    argument or a directory nanotrain cannot start from (one ``error:`` line on stderr)."""
    return answer(lambda: _main(argv), HFError)


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="Hugging Face model directory (config.json + *.safetensors)")
    args = parser.parse_args(argv)
    check_path("PATH", args.path, DIR, HFError)
    hf = open_hf_dir(args.path)
    mapping = hf_family(hf, args.path).hf
    problems = mapping.unsupported(hf.config)
    if problems:  # all of them, on the one line
        raise HFError(f"{args.path}: " + "; ".join(problems))
    print(f"# from {Path(args.path).resolve()}/config.json")
    print(mapping.model_yaml(hf.config), end="")
    print(f"checkpoints:\n  init_from_hf: {Path(args.path).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
