"""The rules between the `eval` section and `checkpoints.eval_job` (per-field ranges: the loader).

What needs the tokenizer (a prompt that leaves no room for its samples) or the files (a source
that does not exist) is checked by the data layer before a launch (``data.check_eval``); here only
what the config alone says.
"""

from __future__ import annotations

from nanotrain.config.loader import ConfigError
from nanotrain.config.schema import Config
from nanotrain.config.validate_slurm import _SLURM_NAME, RUN_NAME


def _fail(message: str):
    raise ConfigError(message)


def validate_named_sources(sources, field: str, what: str, labels: str, example: str) -> None:
    """Each of ``sources`` (``data.sources``, ``eval.sources``) has a unique name fit for a
    TensorBoard tag (it labels ``labels``) and a source."""
    names = set()
    for i, src in enumerate(sources):
        where = f"{field}[{i}]"
        if not src.name:
            _fail(f"{where}.name: every {what} needs a name (it labels {labels}), e.g. name: {example}")
        if not RUN_NAME.match(src.name):
            _fail(f"{where}.name: {src.name!r} must be letters, digits, '.', '_' or '-' (it names TensorBoard tags)")
        if src.name in names:
            _fail(f"{where}.name: {src.name!r} is used twice; give every {what} its own name")
        names.add(src.name)
        if not src.source:
            _fail(f"{where}.source: missing; set it to files, a directory, a glob or a hub dataset name")


def validate_eval(config: Config) -> None:
    """`eval.sources` named, unique and set; `eval.prompts` not empty; an enabled
    `checkpoints.eval_job` with something to evaluate and an inert partition name."""
    e, job = config.eval, config.checkpoints.eval_job
    validate_named_sources(e.sources, "eval.sources", "evaluation source", "eval/<name>/loss", "held")
    for i, prompt in enumerate(e.prompts):
        if not prompt:
            _fail(f"eval.prompts[{i}]: an empty prompt; give the text the samples continue")
    if job.enabled and not (e.sources or e.prompts):
        _fail(
            "checkpoints.eval_job.enabled: eval.sources and eval.prompts are both empty, so the job would "
            "evaluate nothing: add eval.sources (name, source, batches) or eval.prompts"
        )
    if job.partition is not None and not _SLURM_NAME.match(job.partition):
        _fail(
            f"checkpoints.eval_job.partition: {job.partition!r} contains characters SLURM names never use "
            "(letters, digits and _.,:|&*[]@+- only)"
        )
