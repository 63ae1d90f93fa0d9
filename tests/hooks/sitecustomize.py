"""Test-only hook (never on the product's path): ``PYTHONPATH=tests/hooks`` plus
``NANOTRAIN_TEST_SLEEP_IN_PP=RANK:STEP`` makes that local rank fall asleep, forever, inside the
first forward action of pipeline step STEP — a rank stuck in its own code, not in a collective,
for the hang tests (tests/test_hang.py). Python imports ``sitecustomize`` at start-up; without the
variable, or in any other rank, this does nothing."""
import os

_spec = os.environ.get("NANOTRAIN_TEST_SLEEP_IN_PP")
if _spec and os.environ.get("RANK") == _spec.split(":")[0] and os.environ.get("NANOTRAIN_LAUNCHER"):
    import time

    from nanotrain.parallel.pipeline_parallel.engine import PipelineEngine
    from nanotrain.parallel.progress import PROGRESS

    _step = int(_spec.split(":")[1])
    _communicate = PipelineEngine._communicate

    def _sleepy_communicate(self, sends, recvs, timer):
        if PROGRESS.step == _step - 1 and PROGRESS.phase.startswith("forward"):
            while True:
                time.sleep(3600)  # asleep inside a pp step: the watchdog must notice
        return _communicate(self, sends, recvs, timer)

    PipelineEngine._communicate = _sleepy_communicate
