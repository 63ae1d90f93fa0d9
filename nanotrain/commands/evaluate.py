"""`submit.py --evaluate RUN_DIR [--step N] [--set ...]`: evaluate one checkpoint here, by hand.

The same evaluation as a `checkpoints.eval_job` job (``runtime/eval_task.py``): the checkpoint
of step N (default: the latest complete one) at whatever topology it was saved, in this one
process (a GPU if there is one, else the CPU), each `eval.sources` entry's loss and perplexity
printed as a row and written into the run's TensorBoard as `eval/<name>/loss` and
`eval/<name>/perplexity` at the checkpoint's step, the `eval.prompts` samples as `eval/samples`.
The `eval` section is the run's own (`<run>/config.yaml`), which `--set` may change or fill in
(`--set 'eval.sources=[{name: held, source: PATH}]'`). Everything that can be checked before
the weights are read is (the config, the sources' files, the prompts, the checkpoint's
meta.json): one `error:` line, exit 2. A source that fails only while it is read is a row
saying so and, after the others, an `error:` line (exit 2); the run's evaluation-job records
are not touched.
"""

from __future__ import annotations

from pathlib import Path

from nanotrain.checkpoint.layout import CheckpointError
from nanotrain.checkpoint.offline_checks import plan_generate
from nanotrain.config import ConfigError, validate
from nanotrain.config.cli_args import refuse
from nanotrain.data.check import check_eval_config
from nanotrain.runtime.eval_task import EvalFailed, evaluate_checkpoint, run_config
from nanotrain.runtime.rundir import CONFIG_FILE


def evaluate_run(run_dir_arg: str, step: int | None, overrides: list[str]) -> int:
    run_dir = Path(run_dir_arg)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"--evaluate {run_dir_arg}: not a run directory (no {CONFIG_FILE}); pass logs/<run>")
    config = run_config(run_dir, overrides)
    validate(config)
    if not (config.eval.sources or config.eval.prompts):
        raise ConfigError(
            f"--evaluate: {run_dir / CONFIG_FILE} has no eval.sources and no eval.prompts, so there is nothing to "
            "evaluate: add them with --set 'eval.sources=[{name: held, source: PATH, batches: 1}]'"
        )
    check_eval_config(config)
    try:
        plan_generate(run_dir, step)  # the checkpoint and its meta.json, before torch is imported
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        evaluate_checkpoint(run_dir, step, config, device=device)
    except (CheckpointError, EvalFailed) as exc:
        return refuse(exc)
    if config.logging.tensorboard:
        print(f"tensorboard: tensorboard --logdir {run_dir}")
    return 0
