"""A checkpoint written by an older nanotrain resumes bit-exact with the current code.

``tests/fixtures/checkpoint_v1`` holds a run directory whose step-3 checkpoint was written (by
``tests/fixtures/make_checkpoint_v1.py``, once) with the code of the commit recorded in its
``expected.json``, when the model still took the parallelism in its constructor; a 3-layer model
with untied embeddings, a dense layer and two MoE layers with a shared expert, so every kind of
parameter name is in it. A copy is resumed the way a user resumes (``submit.py --resume RUN_DIR
--local``) and trained to step 6: the logged losses of steps 4..6 and and the parameter names must be
the same.

What "bit-exact" is compared with. The step-6 parameters are arithmetic done on this machine's
CPU: the same code gives other bits under other kernels (``ATEN_CPU_CAPABILITY`` avx512, avx2 and
default: three digests on one machine, and the machine that wrote the fixture a fourth; the old
code resumed here gives this machine's). So ``expected.json``'s ``param_digest`` records the
writing machine, and the tests compare what carries across machines: (1) loading is lossless,
every tensor the old checkpoint holds (parameters, AdamW moments, RNG states) and its run state
(step, consumed samples, scheduler) come back and are saved again bit for bit by the current code;
(2) resuming the old checkpoint and resuming that re-save, in the current format, give the same
step-6 parameters, bit for bit, and both log the old code's losses of steps 4..6 exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from nanotrain.checkpoint import load_checkpoint, save_checkpoint
from nanotrain.checkpoint.layout import read_meta
from nanotrain.config import load_config
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.optim import build_lr_scheduler, build_optimizer

from helpers import compat
from helpers.compat import FINAL_STEP, FIXTURE, RESUME_STEP, RUN, TIMEOUT_S, step_dir
from helpers.runs import tb_losses

WRITTEN_BY = "0737cb9879fa38fde1d58caa3e90ceacc19b547e"  # the code before the model became plain


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((FIXTURE / "expected.json").read_text())


def _copy_fixture(work: Path) -> Path:
    """The fixture's inputs and run directory copied into ``work``; returns the run directory."""
    for name in compat.INPUTS:
        shutil.copy(FIXTURE / name, work / name)
    shutil.copytree(FIXTURE / RUN, work / RUN)
    return work / RUN


def _resaved(out: Path) -> Path:
    """The fixture's step-3 checkpoint loaded by the current code into a one-process model,
    optimizer and scheduler built as the trainer builds them, then saved again under ``out``;
    returns the new step directory. Nothing runs between the load and the save (RNG untouched)."""
    config = load_config(str(FIXTURE / RUN / "config.yaml"))
    model = build_llama(config.model, None)
    optimizer = build_optimizer(model.named_parameters(), config.optimizer, zero_stage=0)
    scheduler = build_lr_scheduler(optimizer, config.optimizer, config.training.train_steps)
    loaded = load_checkpoint(
        FIXTURE / RUN / "checkpoints", model, optimizer, scheduler, config=config, move_damaged=False
    )
    assert loaded.step == RESUME_STEP and not loaded.resharded and loaded.rng_restored
    return save_checkpoint(
        out,
        loaded.step,
        model,
        optimizer,
        scheduler,
        extra=loaded.extra,
        config=config,
        keep_last=None,
        rank_state=loaded.rank_state,
        run_id=loaded.meta["run_id"],
    )


def _contents(step: Path) -> dict:
    """Every safetensors file of a step directory: {relative path: (its metadata, {name: (dtype,
    shape, raw bytes)})}, the values compared as bytes."""
    out = {}
    for path in sorted(step.rglob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            tensors = {}
            for name in f.keys():
                value = f.get_tensor(name)
                tensors[name] = (value.dtype.str, value.shape, value.tobytes())
            out[str(path.relative_to(step))] = (f.metadata(), tensors)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(the finished process, its run directory): a copy of the fixture resumed to the end."""
    work = tmp_path_factory.mktemp("checkpoint_v1")
    run = _copy_fixture(work)
    return compat.submit(work, "--resume", str(run)), run


@pytest.fixture(scope="module")
def resaved(tmp_path_factory) -> Path:
    """The step directory of ``_resaved``: the fixture's state in the current code's format."""
    return _resaved(tmp_path_factory.mktemp("resaved") / "checkpoints")


def test_fixture_is_the_old_codes(expected):
    """Rerunning the script with newer code would replace the evidence it keeps."""
    assert expected["written_by"]["commit"] == WRITTEN_BY
    assert (expected["resume_step"], expected["final_step"]) == (RESUME_STEP, FINAL_STEP)


def test_old_checkpoint_loads_losslessly(resaved):
    """Every tensor and the run state of the old checkpoint, loaded and saved again by the
    current code: the same bits in the same files under the same names."""
    old = step_dir(FIXTURE / RUN, RESUME_STEP)
    assert _contents(resaved) == _contents(old)
    new_meta, old_meta = read_meta(resaved), read_meta(old)
    for key in ("step", "extra", "topology", "scheduler", "param_groups", "run_id"):
        assert new_meta[key] == old_meta[key], key


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_old_checkpoint_resumes_bit_exact(resumed, resaved, expected, tmp_path):
    proc, run_dir = resumed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"at step {RESUME_STEP} (same topology)" in proc.stdout
    assert tb_losses(run_dir) == [tuple(pair) for pair in expected["losses"]]  # bit for bit
    # The same state in the current format, resumed the same way: the same run, bit for bit.
    twin = _copy_fixture(tmp_path)
    shutil.rmtree(step_dir(twin, RESUME_STEP))
    shutil.copytree(resaved, step_dir(twin, RESUME_STEP))
    twin_proc = compat.submit(tmp_path, "--resume", str(twin))
    assert twin_proc.returncode == 0, twin_proc.stdout[-3000:] + twin_proc.stderr[-3000:]
    assert tb_losses(twin) == tb_losses(run_dir)
    assert compat.param_digest(step_dir(run_dir, FINAL_STEP)) == compat.param_digest(step_dir(twin, FINAL_STEP))


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_parameter_names_unchanged(resumed, expected):
    """The old checkpoint's names (its safetensors keys and its index) are the resumed model's,
    as the current code saves them."""
    proc, run_dir = resumed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    old = step_dir(FIXTURE / RUN, RESUME_STEP)
    names = sorted(compat.model_tensors(old))
    assert names == expected["param_names"]
    assert sorted(read_meta(old)["index"]["model"]) == names
    assert sorted(compat.model_tensors(step_dir(run_dir, FINAL_STEP))) == names
