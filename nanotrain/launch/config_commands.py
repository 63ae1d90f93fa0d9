"""The commands that take a config, run nothing on a cluster and submit nothing: `--plan` (the
layouts to use) and `--rehearse` (ranks of the job on CPU). Each answers a bad request with one
`error:` line (a ConfigError, printed by ``cli.main``).
"""
from __future__ import annotations

from nanotrain.config import ConfigError, load_config, validate


def plan_flags(args) -> list[str]:
    """The --plan-only flags given (each one alone asks for a plan)."""
    given = [("--gpus", args.gpus), ("--gpu-memory-gb", args.gpu_memory_gb), ("--gpu-tflops", args.gpu_tflops),
             ("--efficiency", args.efficiency), ("--intra-node-gbs", args.intra_node_gbs),
             ("--inter-node-gbs", args.inter_node_gbs)]
    return [flag for flag, value in given if value is not None]


def config_for(args, mode: str, given: list[str], what: str, usage: str):
    """The config ``mode`` (--plan, --rehearse) works on, after the request's own checks: its
    flags (``given``) need the mode, --resume, --status and --local do not apply, a config is
    required (``usage`` says how to pass it)."""
    if not getattr(args, mode.lstrip("-")):
        raise ConfigError(f"{given[0]} only applies to {mode}: add {mode}")
    other = [flag for flag, on in (("--resume", args.resume is not None), ("--status", args.status is not None),
                                   ("--local", args.local)) if on]
    if other:
        raise ConfigError(f"{mode} {what}; it cannot be combined with {other[0]}")
    if args.config is None:
        raise ConfigError(f"{mode} needs a config: {usage}")
    return load_config(args.config, args.set)


def plan(args) -> int:
    """`--plan`: the best layouts for the GPUs asked (plan.py); one `error:` line and exit 2
    for a bad request, or when no layout fits (with what would help)."""
    from nanotrain.launch import plan as planner

    config = config_for(args, "--plan", plan_flags(args), "takes a config and proposes layouts",
                        "submit.py CONFIG --plan [--gpus N] [--gpu-memory-gb G]")
    gpus, memory = planner.check_request(config, args.gpus, args.gpu_memory_gb)
    hw = planner.hardware(config, peak_tflops=args.gpu_tflops, efficiency=args.efficiency,
                          intra_node_gbs=args.intra_node_gbs, inter_node_gbs=args.inter_node_gbs)
    result = planner.make_plan(config, gpus, memory, hw)
    for line in planner.render(result, args.config, memory, args.set):
        print(line)
    if not result.proposals:
        raise ConfigError(planner.explain_none(result, config))
    return 0


def rehearse(args) -> int:
    """`--rehearse`: ranks of the job on the stand-in device (nanotrain/rehearse); exit 1 on a
    defect, one `error:` line and exit 2 for a bad request or a config that cannot be built."""
    from nanotrain.data import check_data_config
    from nanotrain.launch.comm_volume import traffic_bytes
    from nanotrain.launch.memory_estimate import describe
    from nanotrain.rehearse.report import rehearse as run
    from nanotrain.rehearse.report import size

    given = [flag for flag, on in (("--rank", args.rank is not None), ("--steps", args.steps is not None),
                                   ("--json", args.json)) if on]
    config = config_for(args, "--rehearse", given, "runs a config's ranks here",
                        "submit.py CONFIG --rehearse [--rank R] [--steps N]")
    validate(config, slurm=config.slurm.gpus_per_node > 0)
    check_data_config(config.data, vocab_size=config.model.vocab_size, config=config)
    code = run(config, args.rank, 3 if args.steps is None else args.steps, args.json)
    if not args.json:
        print("beside --dry-run's estimate (the busiest rank):")
        for line in describe(config):
            print(f"  {line}")
        print("beside --plan's volumes (bytes one rank of each pp stage sends per step):")
        p = config.parallelism
        for pp in sorted({0, p.pp // 2, p.pp - 1}):
            sent = traffic_bytes(config, pp)
            print(f"  pp rank {pp}: " + (", ".join(f"{axis} {size(b)}" for axis, b in sent.items() if b) or "none"))
    return code
