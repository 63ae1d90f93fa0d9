"""Issue 17, items 1 and 2b at the checkpoint level (one process, real files): a damaged
checkpoint is moved aside and replaced, never trusted by a save, never counted or pruned in
favour of; another run's checkpoints are refused and never pruned."""

from __future__ import annotations

import json

import pytest
import torch

from nanotrain.checkpoint import CheckpointMismatch, load_checkpoint, read_latest, save_checkpoint
from nanotrain.checkpoint.format import verify_checkpoint

from helpers.checkpoints import damage, tiny, tiny_step


def names(root):
    return sorted(p.name for p in root.iterdir())


def params(objs):
    return {n: p.detach().clone() for n, p in objs[0].named_parameters()}


def test_damaged_latest_is_moved_aside_and_rewritten_by_the_retrained_run(tmp_path):
    """The report: resume falls back from a damaged step 20 to 15, retrains to 20; the save at 20
    was skipped (latest named 20 and COMPLETE existed), so the damage stayed `latest` forever."""
    root = tmp_path / "ck"
    objs = tiny()
    for step in range(1, 21):
        tiny_step(objs, step)
        if step % 5 == 0:
            save_checkpoint(root, step, *objs, keep_last=3, extra={"consumed_samples": step})
    damage(root / "step_000020" / "model" / "pp-00_tp-00.safetensors", "flip")

    resumed = tiny(9)
    res = load_checkpoint(root, *resumed)
    assert res.step == 15 and len(res.skipped) == 1
    assert "step_000020.damaged" in names(root) and "step_000020" not in names(root)
    reason = (root / "step_000020.damaged" / "DAMAGED.txt").read_text()
    assert "pp-00_tp-00.safetensors" in reason and "sha256 mismatch" in reason
    assert read_latest(root) == "step_000015"

    for step in range(16, 21):  # retrain 16..20 from the fallback
        tiny_step(resumed, step)
    expected = params(resumed)
    save_checkpoint(root, 20, *resumed, keep_last=3, extra={"consumed_samples": 20})
    assert read_latest(root) == "step_000020" and verify_checkpoint(root / "step_000020") == []
    again = tiny(3)
    assert load_checkpoint(root, *again).step == 20
    assert all(torch.equal(p, expected[n]) for n, p in again[0].named_parameters())
    assert "step_000020.damaged" in names(root)  # kept for inspection, never counted
    assert [n for n in names(root) if n.startswith("step_") and "." not in n] == [
        "step_000010",
        "step_000015",
        "step_000020",
    ]


def test_a_save_verifies_the_checkpoint_it_would_skip(tmp_path):
    root = tmp_path / "ck"
    objs = tiny()
    tiny_step(objs, 0)
    save_checkpoint(root, 1, *objs)
    meta = (root / "step_000001" / "meta.json").read_bytes()
    save_checkpoint(root, 1, *objs)  # intact and latest: skipped (same meta.json, same bytes)
    assert (root / "step_000001" / "meta.json").read_bytes() == meta and names(root) == ["latest", "step_000001"]
    damage(root / "step_000001" / "optimizer" / "pp-00_tp-00_dp-00.safetensors", "truncate")
    save_checkpoint(root, 1, *objs)  # damaged: moved aside and written again, not trusted
    assert names(root) == ["latest", "step_000001", "step_000001.damaged"]
    assert verify_checkpoint(root / "step_000001") == []
    fresh = tiny(4)
    assert load_checkpoint(root, *fresh).step == 1
    assert all(torch.equal(p, q) for p, q in zip(fresh[0].parameters(), objs[0].parameters()))


def test_keep_last_never_prunes_the_last_good_checkpoint_for_a_damaged_one(tmp_path):
    root = tmp_path / "ck"
    objs = tiny()
    for step in (10, 15):
        tiny_step(objs, step)
        save_checkpoint(root, step, *objs, keep_last=3)
    damage(root / "step_000015" / "model" / "pp-00_tp-00.safetensors", "truncate")
    tiny_step(objs, 20)
    save_checkpoint(root, 20, *objs, keep_last=2)  # keeps 20 and the newest *intact* older one
    assert names(root) == ["latest", "step_000010", "step_000015.damaged", "step_000020"]
    (root / "step_000020" / "meta.json").write_text("{}")  # now the newest is damaged too
    res = load_checkpoint(root, *tiny(2))
    assert res.step == 10 and "step_000020.damaged" in names(root)


def test_another_runs_checkpoints_are_refused_and_never_pruned(tmp_path):
    root = tmp_path / "ck"
    objs = tiny()
    for step in (1, 2):
        save_checkpoint(root, step, *objs, run_id="run-a", keep_last=1)
    assert names(root) == ["latest", "step_000002"]
    with pytest.raises(CheckpointMismatch, match="belongs to another run.*run-a.*checkpoints.allow_foreign") as err:
        load_checkpoint(root, *tiny(1), run_id="run-b")
    assert "\n" not in str(err.value)
    assert names(root) == ["latest", "step_000002"]  # a refusal is not damage: nothing moved
    res = load_checkpoint(root, *tiny(1), run_id="run-b", allow_foreign=True)
    assert res.step == 2
    for step in (3, 4, 5):
        save_checkpoint(root, step, *objs, run_id="run-b", keep_last=1)
    assert names(root) == ["latest", "step_000002", "step_000005"]  # run-a's step 2 survives
    meta = json.loads((root / "step_000005" / "meta.json").read_text())
    assert meta["run_id"] == "run-b"
    assert load_checkpoint(root, *tiny(1), run_id="run-b").step == 5
