"""`training.profile: {start_step, num_steps}`: torch.profiler traces of the asked steps.

Each rank writes `<run>/profile/rank-R.steps-S-E.pt.trace.json` (Chrome trace format: CPU ops,
CUDA kernels on a GPU, memory events), which TensorBoard's profiler plugin
(`tensorboard --logdir logs/<run>/profile`) and Perfetto (ui.perfetto.dev) open. Each step is a
`ProfilerStep#N` range, so a pipeline bubble or a slow collective is seen per rank.
Off by default; off, the trainer holds None here and pays one `is None` per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

PROFILE_DIR = "profile"


class StepProfiler:
    """``before(step)`` / ``after(step)`` around each 1-based step; traces steps
    ``start_step .. start_step + num_steps - 1`` and writes the file after the last one."""

    def __init__(self, start_step: int, num_steps: int, run_dir: Path, rank: int):
        self.first, self.last = start_step, start_step + num_steps - 1
        self.path = Path(run_dir) / PROFILE_DIR / f"rank-{rank}.steps-{self.first}-{self.last}.pt.trace.json"
        self._prof: Optional[profile] = None

    @classmethod
    def from_config(cls, profile_cfg: Optional[dict], run_dir: Path, rank: int) -> Optional["StepProfiler"]:
        if not profile_cfg:
            return None
        return cls(int(profile_cfg["start_step"]), int(profile_cfg["num_steps"]), run_dir, rank)

    def before(self, step: int) -> None:
        if step == self.first and self._prof is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, profile_memory=True, record_shapes=False, with_stack=False)
            self._prof.start()
        if self._prof is not None:
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step_range.__enter__()

    def after(self, step: int) -> None:
        if self._prof is None:
            return
        self._step_range.__exit__(None, None, None)
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when training ends inside the window)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
