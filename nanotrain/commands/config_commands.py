"""The commands that take a config, run nothing on a cluster and submit nothing: `--plan` (the
layouts to use) and `--rehearse` (ranks of the job on CPU). Each answers a bad request with one
`error:` line (a ConfigError, printed by ``cli.main``).
"""

from __future__ import annotations

from nanotrain.config import ConfigError, load_config, validate


def config_for(args, mode: str, usage: str):
    """The config ``mode`` (--plan, --rehearse) works on; which flags may come with it was
    checked by flags.py's table. Raises ConfigError without a config (``usage`` says how)."""
    if args.config is None:
        raise ConfigError(f"{mode} needs a config: {usage}")
    return load_config(args.config, args.set)


def plan(args) -> int:
    """`--plan`: the best layouts for the GPUs asked (plan.py); one `error:` line and exit 2
    for a bad request, or when no layout fits (with what would help)."""
    from nanotrain.estimate import plan as planner
    from nanotrain.logging.flops import attention_accounting

    config = config_for(args, "--plan", "submit.py CONFIG --plan [--gpus N] [--gpu-memory-gb G]")
    gpus, memory = planner.check_request(config, args.gpus, args.gpu_memory_gb)
    hw = planner.hardware(
        config,
        peak_tflops=args.gpu_tflops,
        efficiency=args.efficiency,
        intra_node_gbs=args.intra_node_gbs,
        inter_node_gbs=args.inter_node_gbs,
    )
    result = planner.make_plan(config, gpus, memory, hw)
    for line in planner.render(result, args.config, memory, args.set) + attention_accounting(config, layout=False):
        print(line)
    if config.slurm.nodes is not None:  # a node range: what the job runs at on its fewest and most nodes
        from nanotrain.estimate.resize import describe_range

        for line in describe_range(config):
            print(line)
    if not result.proposals:
        raise ConfigError(planner.explain_none(result, config))
    return 0


def rehearse(args) -> int:
    """`--rehearse`: ranks of the job on the stand-in device (nanotrain/rehearse); exit 1 on a
    defect, one `error:` line and exit 2 for a bad request or a config that cannot be built."""
    from nanotrain.data import check_data_config
    from nanotrain.estimate.comm_volume import traffic_bytes
    from nanotrain.estimate.memory import describe
    from nanotrain.rehearse.report import rehearse as run
    from nanotrain.rehearse.report import size

    config = config_for(args, "--rehearse", "submit.py CONFIG --rehearse [--rank R] [--steps N]")
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
