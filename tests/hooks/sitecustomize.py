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
