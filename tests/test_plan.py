"""`submit.py CONFIG --plan` (issue 14, item 3): the proposals are ready `--set` lines that pass the
real validation, keep the global batch, fit the memory the estimate gives them, and come ranked
by the cost model; a model that fits nowhere and every bad request is one `error:` line, exit 2;
the answer for 8 to 262,144 GPUs costs under 2 CPU seconds."""

from __future__ import annotations

import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.commands.cli import main
from nanotrain.config import load_config, validate
from nanotrain.estimate import plan as planner
from nanotrain.estimate.memory import estimate_memory

from helpers.runs import set_args

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "3d_16gpu.yaml"
LLAMA_8B = [
    "model.hidden_size=4096",
    "model.num_layers=32",
    "model.num_attention_heads=32",
    "model.num_key_value_heads=8",
    "model.intermediate_size=14336",
    "model.vocab_size=128256",
    "training.sequence_length=8192",
    "model.max_position_embeddings=8192",
    "slurm.gpus_per_node=8",
]


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _sets(extra):
    return set_args(extra)


def _proposals(out: str, config=CONFIG) -> list[tuple[str, list[str]]]:
    """(summary line, --set assignments) of each proposal printed."""
    lines = out.splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.match(r"#\d+ ", line):
            words = shlex.split(lines[i + 1])
            assert words[:3] == ["python", "submit.py", str(config)], lines[i + 1]
            found.append((line, [words[j + 1] for j, w in enumerate(words) if w == "--set"]))
    return found


@pytest.mark.parametrize(
    "gpus,extra", [(16, []), (512, ["slurm.gpus_per_node=8"]), (4096, ["slurm.gpus_per_node=8"]), (64, LLAMA_8B)]
)
def test_proposals_validate_fit_and_keep_the_batch(gpus, extra, capsys):
    base = load_config(CONFIG, extra)
    batch = base.training.micro_batch_size * base.training.batch_accumulation_per_replica * base.parallelism.dp
    code, out, err = run_cli([CONFIG, "--plan", "--gpus", gpus, "--gpu-memory-gb", 80, *_sets(extra)], capsys)
    assert code == 0 and err == "", err
    budget = 80 * (1 - planner.MARGIN) - planner.RESERVED_GB
    assert f"<= {budget:.1f} GB" in out and f"plan: {gpus} GPUs" in out
    found = _proposals(out)
    assert len(found) == planner.SHOWN
    steps = []
    for summary, assignments in found:
        # What the user would run: the config with the printed overrides after the plan's own.
        config = load_config(CONFIG, extra + assignments)
        layout = validate(config, slurm=True)  # raises on anything validation refuses
        assert layout.nodes * layout.gpus_per_node == gpus == config.parallelism.world_size
        t = config.training
        assert t.micro_batch_size * t.batch_accumulation_per_replica * config.parallelism.dp == batch
        memory = estimate_memory(config).total
        assert memory <= budget
        assert f"memory {planner.gb(memory)} GB" in summary
        mfu = float(re.search(r"MFU ([\d.]+)%", summary).group(1))
        assert 0 < mfu < 100
        steps.append(float(re.search(r"step ([\d.e+-]+) s", summary).group(1)))
    assert steps == sorted(steps)  # best first


def test_cpu_config_plans_for_gpus(capsys):
    """A CPU config (slurm.gpus_per_node: 0) is planned as 8-GPU nodes and validated locally."""
    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    code, out, err = run_cli([tiny, "--plan", "--gpus", 8], capsys)
    assert code == 0 and err == "" and "(8 per node)" in out
    found = _proposals(out, tiny)
    assert found
    for _, assignments in found:
        config = load_config(tiny, assignments)
        validate(config)
        assert config.parallelism.world_size == 8


def test_cost_model_ranks_what_it_should():
    """The cost model's parts move the right way: a bubble only with pp, shrinking with the
    micro-batch count and virtual stages; recompute costs time; tp over nodes costs more."""
    base = load_config(CONFIG, LLAMA_8B)
    hw = planner.hardware(base)

    def cost(**layout):
        config = load_config(CONFIG, LLAMA_8B + [f"{k.replace('__', '.')}={v}" for k, v in layout.items()])
        return planner.step_time(config, hw)

    one = cost(parallelism__dp=1, parallelism__pp=4, training__batch_accumulation_per_replica=8)
    more = cost(parallelism__dp=1, parallelism__pp=4, training__batch_accumulation_per_replica=16)
    interleaved = cost(
        parallelism__dp=1,
        parallelism__pp=4,
        training__batch_accumulation_per_replica=8,
        parallelism__pp_engine="interleaved_1f1b",
        parallelism__pp_virtual_stages=2,
    )
    assert one[2]["bubble"] == pytest.approx(one[2]["compute"] * 3 / 8)
    assert more[2]["bubble"] / more[2]["compute"] == pytest.approx(3 / 16)
    assert interleaved[2]["bubble"] == pytest.approx(one[2]["bubble"] / 2)
    flat = {"parallelism__dp": 16, "parallelism__tp": 1, "parallelism__pp": 1}
    none = cost(**flat)
    assert none[2]["bubble"] == 0 and none[2]["tp"] == 0
    full = cost(**flat, training__recompute="full")
    selective = cost(**flat, training__recompute="selective")
    assert none[0] < selective[0] < full[0] and full[1] == none[1]  # model FLOPs unchanged
    assert 1.25 < full[2]["compute"] / none[2]["compute"] < 1.4  # one more forward of the layers
    tp8 = load_config(
        CONFIG,
        LLAMA_8B
        + ["parallelism.dp=1", "parallelism.tp=8", "parallelism.pp=1", "training.batch_accumulation_per_replica=64"],
    )
    inside = planner.step_time(tp8, hw)
    across = planner.step_time(tp8, planner.Hardware(gpus_per_node=4))
    assert across[2]["tp"] > 5 * inside[2]["tp"] > 0


def test_fits_nowhere_says_so_and_what_would_help(capsys):
    huge = [
        "model.hidden_size=16384",
        "model.num_layers=8",
        "model.intermediate_size=53248",
        "model.num_attention_heads=128",
        "model.num_key_value_heads=8",
        "slurm.gpus_per_node=8",
    ]
    code, out, err = run_cli([CONFIG, "--plan", "--gpus", 8, "--gpu-memory-gb", 16, *_sets(huge)], capsys)
    assert code == 2
    line = err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: no layout of 8 GPUs fits")
    assert "leanest valid one" in line and "GB per GPU" in line
    for hint in ("--gpu-memory-gb", "training.sequence_length"):
        assert hint in line
    assert "#1" not in out
    # The GPU count it names is the first doubling where a layout fits: half of it has none.
    fewest = int(re.search(r"more GPUs \(--gpus ([\d,]+) fits\)", line).group(1).replace(",", ""))
    code, out, _ = run_cli([CONFIG, "--plan", "--gpus", fewest, "--gpu-memory-gb", 16, *_sets(huge)], capsys)
    assert code == 0 and "#1 " in out
    if fewest > 16:
        assert run_cli([CONFIG, "--plan", "--gpus", fewest // 2, "--gpu-memory-gb", 16, *_sets(huge)], capsys)[0] == 2


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--plan", "--gpus", "0"], "--gpus 0: plan for at least 1 GPU"),
        (["--plan", "--gpus", "-8"], "--gpus -8: plan for at least 1 GPU"),
        (["--plan", "--gpus", "2000000"], "at most 1,048,576 ranks"),
        (["--plan", "--gpus", "18"], "--gpus 18 is not a multiple of slurm.gpus_per_node (4): plan for 16 or 20"),
        (["--plan", "--gpus", "2"], "--gpus 2 is not a multiple of slurm.gpus_per_node (4): plan for 4 GPUs"),
        (["--plan", "--gpu-memory-gb", "0"], "--gpu-memory-gb 0: give the memory of one GPU"),
        (["--plan", "--gpu-memory-gb", "2"], "nothing is left after the 2 GB reserve"),
        (["--plan", "--efficiency", "1.5"], "--efficiency 1.5: must be a fraction of peak"),
        (["--plan", "--inter-node-gbs", "-1"], "--inter-node-gbs -1: must be a positive number"),
        (["--gpus", "16"], "--gpus only applies to --plan: add --plan"),
        (["--plan", "--dry-run"], "not allowed with argument"),
        (["--plan", "--local"], "cannot be combined with --local"),
        (["--plan", "--status", "logs/x"], "cannot be combined with --status"),
        (["--plan", "--gpus", "eight"], "invalid int value"),
    ],
)
def test_bad_requests_are_one_error_line(args, fragment, capsys):
    code, out, err = run_cli([CONFIG, *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert "#1" not in out


def test_plan_needs_a_config(capsys):
    code, _, err = run_cli(["--plan", "--gpus", "8"], capsys)
    assert code == 2 and err.startswith("error: --plan needs a config")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("gpus", [8, 262144])
def test_plan_answers_in_under_2_cpu_seconds(gpus):
    """CPU seconds of the whole `submit.py --plan` process (interpreter and imports included),
    as the 512-node --dry-run test measures them; wall time is only bounded against hangs."""
    before, start = _children_cpu_seconds(), time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), str(CONFIG), "--plan", "--gpus", str(gpus), *_sets(LLAMA_8B)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    cpu, wall = _children_cpu_seconds() - before, time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert f"plan: {gpus} GPUs" in proc.stdout and "#1 " in proc.stdout
    assert cpu < 2.0, f"--plan for {gpus} GPUs took {cpu:.2f} CPU s ({wall:.2f} s wall)"


def test_plan_proposes_zero2_where_zero1_does_not_fit():
    """An 8B model on 16 GPUs of 24 GB with a small global batch: a layout whose ZeRO-2
    variant fits and whose ZeRO-1 variant does not is proposed at stage 2."""
    extra = ["parallelism.dp=16", "parallelism.tp=1", "parallelism.pp=1", "parallelism.cp=1"]
    extra += ["training.micro_batch_size=1", "training.batch_accumulation_per_replica=2"]
    config = load_config(CONFIG, LLAMA_8B + extra)
    plan = planner.make_plan(config, 16, 24, planner.hardware(config))
    helped = [
        p
        for p in plan.proposals
        if p.config.optimizer.zero_stage == 2
        and estimate_memory(planner._with(p.config, optimizer=dict(zero_stage=1))).total > plan.budget_gb
    ]
    assert helped, [p.summary() for p in plan.proposals]
    assert all(p.memory_gb <= plan.budget_gb for p in helped)
    assert "--set optimizer.zero_stage=2" in helped[0].set_args()


def test_plan_proposes_zero3_where_zero2_does_not_fit():
    """An 8B model on 16 GPUs of 16 GB: a layout that fits only with the parameters sharded too
    is proposed at stage 3 and printed as zero3; its dp time counts the 3m collectives."""
    extra = ["parallelism.dp=16", "parallelism.tp=1", "parallelism.pp=1", "parallelism.cp=1"]
    extra += ["training.micro_batch_size=1", "training.batch_accumulation_per_replica=2"]
    config = load_config(CONFIG, LLAMA_8B + extra)
    plan = planner.make_plan(config, 16, 16, planner.hardware(config))
    helped = [
        (p, planner._with(p.config, optimizer=dict(zero_stage=2)))
        for p in plan.proposals
        if p.config.optimizer.zero_stage == 3
    ]
    helped = [(p, two) for p, two in helped if estimate_memory(two).total > plan.budget_gb]
    assert helped, [p.summary() for p in plan.proposals]
    prop, two = helped[0]
    assert prop.memory_gb <= plan.budget_gb and prop.summary().endswith(" zero3")
    assert "--set optimizer.zero_stage=3" in prop.set_args()
    assert any(line.startswith("#") and " zero3: memory" in line for line in planner.render(plan, "c.yaml", 16))
    assert prop.parts["dp"] > planner.step_time(two, plan.hw)[2]["dp"]
