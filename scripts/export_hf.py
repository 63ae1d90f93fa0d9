#!/usr/bin/env python
"""Export a nanotrain run or checkpoint as a Hugging Face directory of its model.family (transformers, vLLM, the Hub).

    python scripts/export_hf.py SRC OUT_DIR [--dtype bfloat16|float32] [--max-shard-size 5GB]

SRC: a run directory (its latest complete checkpoint), a checkpoints root, or one checkpoint
directory, saved at any (dp, tp, pp, cp, ZeRO stage). OUT_DIR (apart from the checkpoint: not it,
not inside it, not holding it) then loads with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``
(the family's class: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``SmolLM3ForCausalLM``, ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``) and
``AutoTokenizer.from_pretrained(OUT_DIR)``. A wrong input is one ``error:`` line and exit status 2,
before anything is written. The work is ``nanotrain.hf.export`` (streamed tensor by
tensor; see its docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.checkpoint.layout import CheckpointError  # noqa: E402
from nanotrain.checkpoint.offline_checks import DEFAULT_MAX_SHARD, DTYPES, plan_export, shard_size  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer  # noqa: E402
from nanotrain.data.errors import DataError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``; module doc); returns 0, or 2 for a wrong
    argument or input (one ``error:`` line on stderr, nothing written), 130 on Ctrl-C."""
    return answer(lambda: _main(argv), CheckpointError, DataError, OSError)  # DataError: the run's tokenizer files


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="run directory, checkpoints root or checkpoint directory")
    parser.add_argument("out_dir", help="Hugging Face model directory to write")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the written weights (default float32: the master weights, exact)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=str(DEFAULT_MAX_SHARD),
        help="split model.safetensors into index-sharded files above this size (default 5GB)",
    )
    args = parser.parse_args(argv)
    max_shard = shard_size(args.max_shard_size)
    plan_export(args.src, args.out_dir, args.dtype)  # every check that needs no torch, first
    # Imported only now: the tensor code costs seconds of torch import, which a wrong argument
    # must not wait for (export_hf repeats the checks above: they read meta.json only).
    from nanotrain.hf.export import export_hf

    result = export_hf(args.src, args.out_dir, args.dtype, max_shard)
    print(
        f"exported {result['checkpoint']} -> {args.out_dir}: {len(result['files'])} weight file(s), "
        f"{result['bytes'] / 1e6:.1f} MB {args.dtype}, {result['seconds']:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
