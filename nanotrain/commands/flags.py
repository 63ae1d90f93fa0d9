"""Which of `submit.py`'s flags go together: one table, checked right after parsing.

Each row is a mode (what the command does) and the flags it accepts. A command line is accepted
when one row holds every flag given and that row's own flag is among them; a command without any
mode flag is the run of a config (the `CONFIG` row), whose missing config is reported later.
``check_flags`` returns the command's ``Mode``: the first such row in table order. A
flag no row pairs with another (`--status` with `--set`, `--gpus` with `--rank`) is one `error:`
line naming both; a mode's flag given without its mode (`--gpus` without `--plan`) is one line
saying which mode to add. Nothing is loaded before this check, so a refused combination never
reads a config, writes a run directory or asks the scheduler anything.

A new mode is one more row (and its flag in the parser); tests/test_cli_flags.py pairs every flag
the parser has, so a flag missing from the table is caught there.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass

from nanotrain.config import ConfigError
from nanotrain.config.cli_args import ArgParser, non_negative_int

CONFIG = "CONFIG"  # the positional config file, as the usage line names it
PLAN_FLAGS = ("--gpus", "--gpu-memory-gb", "--gpu-tflops", "--efficiency", "--intra-node-gbs", "--inter-node-gbs")
REHEARSE_FLAGS = ("--rank", "--steps", "--json")
SWEEP_FLAGS = ("--sweep", "--sweep-mode")  # a config's points (commands/sweep.py); not with --resume


class Mode(enum.Enum):
    """What one command does, named by its row's flag in ``MODES``."""

    PLAN = "--plan"
    REHEARSE = "--rehearse"
    PREPARE_DATA = "--prepare-data"
    STATUS = "--status"
    EVALUATE = "--evaluate"
    RESUME = "--resume"
    EMIT = "--emit"
    DRY_RUN = "--dry-run"
    LOCAL = "--local"
    RUN = CONFIG

    @property
    def launches(self) -> bool:
        """Whether the command starts or submits work (a run, a data preparation); --dry-run and
        --emit only show or write the job, --plan, --rehearse and --status launch nothing."""
        return self in (Mode.PREPARE_DATA, Mode.RESUME, Mode.LOCAL, Mode.RUN)


@dataclass(frozen=True)
class Row:
    """One row: the mode's flag; what it does (the start of its error lines); what it works on,
    at most one of ``targets`` (a config, or the run directory of --resume); the other flags it
    accepts."""

    flag: str
    does: str
    targets: tuple[str, ...]
    accepts: tuple[str, ...]

    def holds(self, flags) -> bool:
        flags = set(flags)
        return flags <= {self.flag, *self.targets, *self.accepts} and len(flags & set(self.targets)) <= 1


EITHER = (CONFIG, "--resume")  # a config file, or the config a run directory was launched with
# Order matters for the wording (of two clashing flags the earlier row's speaks) and for the mode
# of a command two rows hold: the earlier row's (`--resume --local` resumes, locally).
MODES = (
    Row("--plan", "takes a config and proposes layouts", (CONFIG,), ("--set", *PLAN_FLAGS)),
    Row("--rehearse", "runs a config's ranks here", (CONFIG,), ("--set", *REHEARSE_FLAGS)),
    Row("--prepare-data", "tokenises a config's data sources", (CONFIG,), ("--set", "--local")),
    Row("--status", "takes a run directory and shows where it stands", (), ()),
    Row("--evaluate", "evaluates a run's checkpoint here", (), ("--step", "--set")),
    Row("--resume", "takes a run directory instead of a config", (), ("--set", "--local")),
    Row("--emit", "writes a SLURM script", EITHER, ("--set",)),
    Row("--dry-run", "validates and shows the launch", EITHER, ("--set", "--local", *SWEEP_FLAGS)),
    Row("--local", "runs the ranks as local processes", EITHER, ("--set", *SWEEP_FLAGS)),
    Row(CONFIG, "runs a config", (), ("--set", "--local", *SWEEP_FLAGS)),
)
DEFAULT = MODES[-1]  # no mode flag given: run a config
_ROW = {mode.flag: mode for mode in MODES}


def flag_name(action: argparse.Action) -> str:
    """How the table (and its error lines) names a parser argument."""
    return action.option_strings[0] if action.option_strings else CONFIG


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags set on this command line (a value other than the parser's default)."""
    return [flag_name(a) for a in parser._actions if a.dest != "help" and getattr(args, a.dest, a.default) != a.default]


def owners(flag: str) -> list[str]:
    """The modes whose row accepts ``flag`` besides the default run."""
    return [mode.flag for mode in MODES if flag in mode.accepts and mode is not DEFAULT]


def together(a: str, b: str) -> bool:
    """Whether some mode accepts both flags (the pairwise view of the table)."""
    return any(mode.holds((a, b)) for mode in MODES)


def _speaks(flag: str) -> str:
    if flag in _ROW:
        return f"{flag} {_ROW[flag].does}"
    return f"{flag} only applies to {' or '.join(owners(flag))}"


def _order(flag: str) -> int:
    return list(_ROW).index(flag) if flag in _ROW else len(_ROW)


def check_flags(flags: list[str]) -> Mode:
    """The mode of a command given ``flags``; ConfigError (one line naming the flags) unless one
    mode accepts all of them."""
    modes = [_ROW[f] for f in flags if f in _ROW] or [DEFAULT]
    for row in MODES:
        if row in modes and row.holds(flags):
            return Mode(row.flag)
    ordered = sorted(flags, key=_order)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if not together(a, b):
                raise ConfigError(f"{_speaks(a)}; it cannot be combined with {b} (see --help)")
    for flag in ordered:
        if not any(mode.holds((mode.flag, flag)) for mode in modes):
            wanted = owners(flag) or [DEFAULT.flag]
            raise ConfigError(f"{flag} only applies to {' or '.join(wanted)}: add {wanted[0]}")
    raise ConfigError(f"{' '.join(ordered)}: no mode takes these flags together (see --help)")


USAGE = """`submit.py CONFIG [--dry-run] [--emit DIR] [--local] [--set section.field=value ...]`,
`submit.py CONFIG [--dry-run] [--local] --sweep section.field=V1,V2 [--sweep ...] [--sweep-mode zip]`,
`submit.py CONFIG --plan [--gpus N] [--gpu-memory-gb G]`, `submit.py --evaluate RUN_DIR [--step N]`,
or `submit.py --status RUN_DIR|SWEEP_DIR`."""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(prog="submit.py", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML config, e.g. configs/tiny_cpu.yaml")
    parser.add_argument(
        "--status",
        metavar="RUN_DIR",
        help="show a run's job state, requeues, last step, loss, tokens/s and ETA (a sweep's: one row per point)",
    )
    parser.add_argument(
        "--evaluate",
        metavar="RUN_DIR",
        help="evaluate a checkpoint of the run here (eval.sources: loss and perplexity; eval.prompts: "
        "samples), into its TensorBoard at the checkpoint's step",
    )
    parser.add_argument(
        "--step",
        type=non_negative_int,
        metavar="N",
        help="--evaluate: the checkpoint of this step (default: the latest complete one)",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped, preempted or failed run from its latest complete checkpoint "
        "(as it ran: SLURM or local; --set may change the topology)",
    )
    parser.add_argument(
        "--set",
        metavar="SECTION.FIELD=VALUE",
        action="append",
        default=[],
        help="override a config field (value parsed as YAML); repeatable",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run", action="store_true", help="validate, print the rank grid and the sbatch script; submit nothing"
    )
    mode.add_argument(
        "--emit", metavar="DIR", help="write a standalone .sbatch script (and its config) to DIR for plain `sbatch`"
    )
    mode.add_argument(
        "--plan",
        action="store_true",
        help="propose the fastest layouts that fit (see nanotrain/estimate/plan.py); submit nothing",
    )
    parser.add_argument("--gpus", type=int, metavar="N", help="--plan: GPUs to plan for (default: the config's)")
    parser.add_argument(
        "--gpu-memory-gb",
        type=float,
        metavar="G",
        help="--plan: memory of one GPU (default: slurm.gpu_memory_gb, else 80)",
    )
    for flag, what in (
        ("--gpu-tflops", "peak bf16 TFLOP/s per GPU"),
        ("--efficiency", "fraction of peak reached"),
        ("--intra-node-gbs", "GB/s per GPU within a node"),
        ("--inter-node-gbs", "GB/s per GPU across nodes"),
    ):
        parser.add_argument(flag, type=float, metavar="X", help=f"--plan cost model: {what}")
    mode.add_argument(
        "--rehearse",
        action="store_true",
        help="run ranks of the real job on CPU (meta device, fake NCCL world) at the real model "
        "shape and world size: train, evaluate, save, load, train; report placement, host "
        "syncs, memory and bytes per group; exit 1 on a defect (nanotrain/rehearse)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        action="append",
        metavar="R",
        help="--rehearse: this global rank (repeatable; default: one rank of every role)",
    )
    parser.add_argument("--steps", type=int, metavar="N", help="--rehearse: training steps (default 3)")
    parser.add_argument("--json", action="store_true", help="--rehearse: print the report as one JSON object")
    mode.add_argument(
        "--prepare-data",
        action="store_true",
        help="tokenise every data source into the cache: a CPU-only SLURM job (slurm.prepare), or here with --local",
    )
    parser.add_argument(
        "--local", action="store_true", help="run as local processes (gloo on CPU) even when SLURM is available"
    )
    parser.add_argument(
        "--sweep",
        metavar="SECTION.FIELD=V1,V2,...",
        action="append",
        default=[],
        help="run the config once per value (each parsed as YAML, like --set); repeatable: the points are "
        "the grid of all lists (or --sweep-mode zip); on SLURM one job array, one run directory per point",
    )
    parser.add_argument(
        "--sweep-mode",
        choices=("grid", "zip"),
        help="--sweep: every combination of the lists (grid, the default) or their i-th values together (zip)",
    )
    return parser
