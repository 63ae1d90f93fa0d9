"""Test-only hook (never on the product's path): ``PYTHONPATH=tests/hooks`` plus
``NANOTRAIN_TEST_SLEEP_IN_PP=RANK:STEP`` makes that local rank fall asleep, forever, inside the
first forward action of pipeline step STEP — a rank stuck in its own code, not in a collective,
for the hang tests (tests/test_hang.py). Python imports ``sitecustomize`` at start-up; without the
variable, or in any other rank, this does nothing."""

import os

_spec = os.environ.get("NANOTRAIN_TEST_SLEEP_IN_PP")
if _spec and os.environ.get("RANK") == _spec.split(":")[0] and os.environ.get("NANOTRAIN_LAUNCHER"):
    import time

    from nanotrain.parallel.observe.hang_record import HANG_RECORD
    from nanotrain.parallel.pipeline_parallel.engine import PipelineEngine

    _step = int(_spec.split(":")[1])
    _communicate = PipelineEngine._communicate

    def _sleepy_communicate(self, sends, recvs, timer):
        if HANG_RECORD.step == _step - 1 and HANG_RECORD.phase.startswith("forward"):
            while True:
                time.sleep(3600)  # asleep inside a pp step: the watchdog must notice
        return _communicate(self, sends, recvs, timer)

    PipelineEngine._communicate = _sleepy_communicate

# ``NANOTRAIN_TEST_SLOW_WRITE=step_000010:SECONDS``: every rank's background checkpoint writer
# (checkpoints.async_save) sleeps that long before writing each file of that checkpoint, so a
# test can act while the write is in flight (kill -9 a rank, preempt the job);
# ``step_000010:until=PATH``: it waits until the test creates PATH instead (at most 10 minutes),
# so the write is in flight for as long as the test needs, however loaded the machine is.
_slow = os.environ.get("NANOTRAIN_TEST_SLOW_WRITE")
if _slow and os.environ.get("NANOTRAIN_LAUNCHER") and os.environ.get("RANK"):
    import threading
    import time

    from nanotrain.checkpoint import format as _fmt

    _dir, _how = _slow.split(":", 1)
    _write = _fmt.write_safetensors

    def _hold():
        if not _how.startswith("until="):
            time.sleep(float(_how))
            return
        deadline = time.monotonic() + 600
        while not os.path.exists(_how[len("until=") :]) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _in_background_save() -> bool:
        # Files are written on pool threads in sync saves too; only an async save has its
        # writer thread alive (at most one save is in flight, and a sync save waits for it).
        return any(t.name == "nanotrain-checkpoint-writer" for t in threading.enumerate())

    def _slow_write(path, tensors, header):
        if f"{_dir}.tmp" in str(path) and _in_background_save():
            _hold()
        return _write(path, tensors, header)

    _fmt.write_safetensors = _slow_write

# ``NANOTRAIN_TEST_SPIKE=poison=5:inf,10:1000;noupdate=5,10;preempt=7`` (tests/test_spike.py), any
# part optional, in every rank: ``poison`` multiplies each micro-batch loss of those steps by the
# factor on the stage that computes it (an injected non-finite or huge gradient); ``noupdate``
# leaves out AdamW's update at those steps (the reference a skipped step must equal: no call of
# the kernel at all); ``preempt`` sends this rank the stop signal (SIGUSR2) as step P ends: a
# preemption at a known step. Keyed on the data instead of the step (a step may run twice under
# `rewind`): ``poisondata=144:inf`` poisons the step that reads from sample position 144 on;
# ``drop=128-160`` leaves the samples at positions 128..159 out of the run (every read position
# from 128 on moves 32 further: the reference of a rewind that left them out). In local ranks
# and in the tasks of a SLURM job (SLURM_PROCID; sbatch exports the variables to every task of
# every incarnation), tests/test_slurm_preemption.py.
_spike = os.environ.get("NANOTRAIN_TEST_SPIKE")
_a_rank = (os.environ.get("NANOTRAIN_LAUNCHER") and os.environ.get("RANK")) or os.environ.get("SLURM_PROCID")
if _spike and _a_rank:
    import signal

    import torch

    from nanotrain.data.device_batches import BatchPrefetcher
    from nanotrain.parallel.observe.hang_record import HANG_RECORD
    from nanotrain.parallel.part.model_part import ModelPart
    from nanotrain.training import stop_vote as _vote_module

    _parts = dict(part.split("=", 1) for part in _spike.split(";") if part)
    _poison = {int(s): float(f) for s, f in (p.split(":") for p in _parts.get("poison", "").split(",") if p)}
    _noupdate = {int(s) for s in _parts.get("noupdate", "").split(",") if s}
    _preempt = int(_parts["preempt"]) if "preempt" in _parts else None
    _poisondata = {int(s): float(f) for s, f in (p.split(":") for p in _parts.get("poisondata", "").split(",") if p)}
    _drop = tuple(int(x) for x in _parts["drop"].split("-")) if "drop" in _parts else None
    _get, _prefetch = BatchPrefetcher.get, BatchPrefetcher.prefetch
    _position = [None]  # the sample position the step in flight reads from

    def _moved(consumed):
        return consumed + _drop[1] - _drop[0] if _drop and consumed >= _drop[0] else consumed

    def _get_moved(self, consumed):
        _position[0] = _moved(consumed)
        return _get(self, _moved(consumed))

    def _prefetch_moved(self, consumed):
        return _prefetch(self, _moved(consumed))

    _forward, _adamw_step, _post = ModelPart.forward, torch.optim.AdamW.step, _vote_module.StopVote.post

    def _poisoned_forward(self, input_ids=None, targets=None, *args, **kwargs):
        out = _forward(self, input_ids, targets, *args, **kwargs)
        factor = _poison.get(HANG_RECORD.step + 1)  # HANG_RECORD.step: the steps done so far
        factor = _poisondata.get(_position[0], factor)
        if factor is None or targets is None or not torch.is_grad_enabled():  # the loss of a training step
            return out
        return out * factor

    def _maybe_update(self, closure=None):
        if HANG_RECORD.step + 1 in _noupdate:
            return None
        return _adamw_step(self, closure)

    def _post_and_preempt(self, step, *args, **kwargs):
        if step == _preempt:
            os.kill(os.getpid(), signal.SIGUSR2)  # the handler sets this rank's stop flag
        return _post(self, step, *args, **kwargs)

    ModelPart.forward = _poisoned_forward
    BatchPrefetcher.get, BatchPrefetcher.prefetch = _get_moved, _prefetch_moved
    torch.optim.AdamW.step = _maybe_update
    _vote_module.StopVote.post = _post_and_preempt
