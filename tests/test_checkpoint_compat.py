"""A checkpoint written by an older nanotrain resumes bit-exact with the current code.

``tests/fixtures/checkpoint_v1`` holds a run directory whose step-3 checkpoint was written (by
``tests/fixtures/make_checkpoint_v1.py``, once) with the code of the commit recorded in its
``expected.json``, when the model still took the parallelism in its constructor; a 3-layer model
with untied embeddings, a dense layer and two MoE layers with a shared expert, so every kind of
parameter name is in it. A copy is resumed the way a user resumes (``submit.py --resume RUN_DIR
--local``) and trained to step 6: the logged losses of steps 4..6 and the step-6 parameters must
equal what the old code got (``==``, no tolerance), and the parameter names must be the same.
"""
from __future__ import annotations

import json
import shutil

import pytest

from nanotrain.checkpoint.layout import read_meta

from helpers import compat
from helpers.compat import FINAL_STEP, FIXTURE, RESUME_STEP, RUN, TIMEOUT_S, step_dir
from helpers.runs import tb_losses

WRITTEN_BY = "0737cb9879fa38fde1d58caa3e90ceacc19b547e"  # the code before the model became plain


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(the finished process, its run directory): a copy of the fixture resumed to the end."""
    work = tmp_path_factory.mktemp("checkpoint_v1")
    for name in compat.INPUTS:
        shutil.copy(FIXTURE / name, work / name)
    shutil.copytree(FIXTURE / RUN, work / RUN)
    return compat.submit(work, "--resume", str(work / RUN)), work / RUN


def test_fixture_is_the_old_codes(expected):
    """Rerunning the script with newer code would replace the evidence it keeps."""
    assert expected["written_by"]["commit"] == WRITTEN_BY
    assert (expected["resume_step"], expected["final_step"]) == (RESUME_STEP, FINAL_STEP)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_old_checkpoint_resumes_bit_exact(resumed, expected):
    proc, run_dir = resumed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"at step {RESUME_STEP} (same topology)" in proc.stdout
    assert tb_losses(run_dir) == [tuple(pair) for pair in expected["losses"]]  # bit for bit
    assert compat.param_digest(step_dir(run_dir, FINAL_STEP)) == expected["param_digest"]


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
