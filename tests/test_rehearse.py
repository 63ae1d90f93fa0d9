"""`--rehearse`: a rank of the real job on the meta device and the fake backend, and the defects it
must name. Each kind of defect is planted once (a revert of a fix, or a new mistake) and the
rehearsal must name it with its call site; the clean tiny job must show none.

The rehearsals run in this process (``rehearse_rank``; the CLI runs each rank in a process of its
own, checked once at the end) on the tiny config's 8-rank grid (dp2 x tp2 x pp2, 1f1b).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotrain.config import load_config
from nanotrain.parallel.grid import RankGrid
from nanotrain.rehearse import report as rehearsal
from nanotrain.rehearse.rank import rehearse_rank

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


@pytest.fixture
def tiny(tmp_path):
    return load_config(
        TINY,
        [
            f"logging.dir={tmp_path / 'logs'}",
            "model.dtype=bfloat16",
            "data.validation.fraction=0.1",
            "training.eval_batches=1",
        ],
    )


def _defects(report: dict) -> list[str]:
    return rehearsal.defects(report)


def test_the_tiny_job_rehearses_clean_with_every_leg(tiny):
    """Build, 3 steps, an evaluation, a save, a load and a step: no defect, and the numbers the
    report rests on are there (memory by category, bf16 on the tp and pp wires, the load's step)."""
    report = rehearse_rank(tiny, 5, 3)  # pp 1 (the last stage), tp 1, dp 0
    assert _defects(report) == []
    assert report["coords"] == {"ep": 0, "pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert report["evaluated"] and report["resumed_at"] == 3
    peak = report["peak"]
    assert min(peak["weights"], peak["grads"], peak["optimizer"], peak["activations"]) > 0
    assert peak["total"] == sum(v for k, v in peak.items() if k != "total")
    wire = rehearsal.step_bytes(report)
    assert ("tp", "all_reduce", "bfloat16") in wire  # activations cross tp in bf16 under autocast
    assert any(g.startswith("pp") and c == "send" and d == "bfloat16" for g, c, d in wire)  # gradients back
    assert any(g.startswith("dp") and d == "float32" for g, c, d in wire)  # fp32 gradients
    assert all(not rows for w, rows in report["syncs"].items() if w in report["silent"])


def test_skipping_spikes_adds_no_host_sync_on_silent_steps(tmp_path):
    """`training.spike.policy: skip` decides on the device (training/spike.py): steps 1-3 stay
    silent; the median window is read on the host only where a save is (its checkpoint state)."""
    config = load_config(TINY, [f"logging.dir={tmp_path / 'logs'}", "training.spike.policy=skip"])
    report = rehearse_rank(config, 4, 3)  # the last stage: the loss is judged there (and everywhere)
    assert _defects(report) == []
    assert report["silent"] and all(not rows for w, rows in report["syncs"].items() if w in report["silent"])


def test_optimizer_state_loaded_on_the_host_is_named(tiny, monkeypatch):
    """The revert of the loaders' fix: `step` back on the host for the fused (device) AdamW."""
    from nanotrain.optim import optimizer
    from nanotrain.parallel.data_parallel import zero

    def host_step(value, param, group, key):
        value = torch.as_tensor(value)
        if key == "step":
            return value.to(torch.float32).reshape(()).clone()
        return value.to(dtype=param.dtype, device=param.device).clone()

    monkeypatch.setattr(zero, "placed_state", host_step)
    monkeypatch.setattr(optimizer, "placed_state", host_step)
    found = _defects(rehearse_rank(tiny, 0, 2))
    assert any(d.startswith("optimizer state after load:") and ".step on cpu" in d for d in found), found
    # ...and the fused kernel that would read it through a device pointer, at its call site
    assert any(d.startswith("placement:") and "_fused_adamw" in d for d in found), found


def test_a_host_sync_on_a_silent_step_is_named(tiny, monkeypatch):
    """A `.item()` of the loss inside every step (a logging shortcut, say)."""
    from nanotrain.training import trainer

    original = trainer.train_step

    def reads_the_loss(*args, **kwargs):
        stats = original(*args, **kwargs)
        float(stats.loss_tensor)
        return stats

    monkeypatch.setattr(trainer, "train_step", reads_the_loss)
    found = _defects(rehearse_rank(tiny, 4, 3))  # the last stage: it holds the loss
    assert any("host sync on silent step 1" in d and "item" in d for d in found), found
    assert any("host sync on silent step 2" in d for d in found), found


def test_the_stop_vote_built_from_host_data_is_named(tiny, monkeypatch):
    """The revert of the stop vote's fix: flags built with torch.tensor(data, device) and read
    back with tolist(), every step."""
    from nanotrain.training import stop_vote

    def post(self, step_no, loss, grad_norm, writing=False, skipped=None, values=None):
        flags = torch.tensor([float(self.stop_code()), 0.0, float(writing)], device=self.device)
        self._pending_host = flags.tolist()

    monkeypatch.setattr(stop_vote.StopVote, "post", post)
    monkeypatch.setattr(stop_vote.StopVote, "settle", lambda self, latest: 0)
    found = _defects(rehearse_rank(tiny, 1, 2))
    # named at the innermost nanotrain line: the loop's call of the (planted, test-file) vote
    assert any("silent step 1: nanotrain/training/trainer.py" in d and "host-to-device" in d for d in found), found
    assert any("silent step 1: nanotrain/training/trainer.py" in d and "device-to-host" in d for d in found), found


def test_a_host_tensor_into_a_collective_is_named(tiny, monkeypatch):
    """The checkpoint world's NCCL branch reverted: its byte tensors stay on the host."""
    from nanotrain.checkpoint import comm

    monkeypatch.setattr(comm.accelerator, "of_backend", lambda backend: None)
    found = _defects(rehearse_rank(tiny, 0, 2))
    assert any(d.startswith("collective: nanotrain/checkpoint/comm.py") and "on cpu" in d for d in found), found


def test_a_host_tensor_in_a_device_op_is_named(tiny, monkeypatch):
    """A host tensor of several elements meeting device tensors (CUDA refuses it; meta too)."""
    from nanotrain.parallel.part import model_part

    original = model_part.ModelPart.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        bias = torch.zeros(out.shape[-1]) if out.dim() else torch.zeros(2)
        return out + bias.sum() * 0 if not out.dim() else out + bias * 0

    monkeypatch.setattr(model_part.ModelPart, "forward", forward)
    report = rehearse_rank(tiny, 0, 2)  # the first stage: its forward returns hidden states
    assert any(d.startswith("placement:") and "host tensor" in d for d in _defects(report)), _defects(report)


# torch.distributed functions that move tensors between ranks (the ones nanotrain may call)
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}


def test_both_contracts_cover_every_collective_nanotrain_calls():
    """Every ``dist.<collective>`` the package calls is checked by the rehearsal's wrapper and by
    the test ranks' contract (``tests/helpers/contract.py``); a new one must be added to both."""
    import ast

    from nanotrain.rehearse import traffic

    from helpers import contract

    called = set()
    for path in (ROOT / "nanotrain").rglob("*.py"):
        if "rehearse" in path.parts:  # the wrapper itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("dist", "_dist")
                and node.attr in COLLECTIVES
            ):
                called.add(node.attr)
    assert {"all_reduce", "gather", "batch_isend_irecv"} <= called  # the scan sees them
    p2p = {"isend", "irecv", "batch_isend_irecv"}  # checked as the batch they go in
    assert called - p2p <= set(traffic._SPECS), called - set(traffic._SPECS)
    assert called - p2p <= set(contract.TENSOR_COLLECTIVES), called - set(contract.TENSOR_COLLECTIVES)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rehearse", "--rank", "8"], "--rank 8: the world of this config has ranks 0..7"),
        (["--rehearse", "--steps", "1"], "--steps 1: at least 2"),
        (["--rank", "0"], "--rank only applies to --rehearse"),
        (["--rehearse", "--local"], "cannot be combined with --local"),
    ],
)
def test_bad_requests_get_one_line(args, message):
    done = subprocess.run(
        [sys.executable, "submit.py", str(TINY), *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


def test_default_ranks_cover_every_role():
    config = load_config(ROOT / "configs" / "3d_16gpu.yaml")
    grid = RankGrid.of(config.parallelism)
    coords = [grid.coords(r) for r in rehearsal.default_ranks(config)]
    assert {c.pp for c in coords} == {0, 1} and {c.tp for c in coords} == {0, 1}
    moe = load_config(ROOT / "configs" / "moe_16gpu.yaml")
    grid = RankGrid.of(moe.parallelism)
    coords = [grid.coords(r) for r in rehearsal.default_ranks(moe)]
    assert {c.ep for c in coords} == {0, moe.parallelism.ep - 1}


def test_the_command_line_reports_and_exits_zero(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "submit.py",
            str(TINY),
            "--rehearse",
            "--rank",
            "0",
            "--steps",
            "2",
            "--set",
            f"logging.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rehearsal: no defect on 1 rank(s)" in done.stdout
    assert "beside --dry-run's estimate" in done.stdout and "stubbed (nothing else is):" in done.stdout
