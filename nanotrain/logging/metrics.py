"""Training metrics of one run: TensorBoard scalars, a console line or bar, and progress.json.

Only one rank logs (the last pipeline stage holds the loss; tp 0, dp 0 of it), so every other rank
builds the logger with `enabled=False` and pays nothing. The caller averages the loss over dp
before handing it over; `should_log(step)` answers the same on every rank, so the dp all-reduce of
the loss can be skipped on steps that are not logged.

    logger = MetricsLogger(run_dir, config_to_dict(config), enabled, total_steps=..., ...)
    for step in range(start_step + 1, total_steps + 1):
        ...                                   # one optimizer step, timed (after a device sync)
        logger.log(step, loss, lr, grad_norm, step_time_s)   # every step, every rank
    logger.close()

Throughput is computed from the `step_time_s` of every step since the previous log line, which is
why `log` is called on every step (it only accumulates on the steps in between).
`<run_dir>/progress.json` is replaced atomically on every log step; `submit.py --status` reads it
and never has to parse TensorBoard event files.
"""

from __future__ import annotations

import datetime as _dt
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from nanotrain.config import config_to_dict
from nanotrain.config.atomic_files import atomic_write_json
from nanotrain.logging.flops import peak_bf16_tflops
from nanotrain.models.llama_arch import training_flops_per_token
from nanotrain.models.llama_parallelize_costs import hardware_flops_per_token, head_chunk_rows

PROGRESS_FILE = "progress.json"
TB_DIR = "tb"
CONFIG_TEXT_TAG = "config"
SCALAR_TAGS = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "perf/tokens_per_sec",
    "perf/tflops_per_gpu",
    "perf/mfu",
    "perf/hfu",
    "mem/peak_gb",
)
# Scalars measured across ranks on log steps (`step_time_ratio`, stragglers.py).
CROSS_RANK_TAGS = ("perf/step_time_max_over_median",)
GIB = 2**30


def peak_memory_gb(device=None) -> float:
    """Peak memory of this process in GiB: CUDA allocator peak on a GPU, else peak RSS (which on a
    CPU run is the whole process: weights, activations and optimizer states live in host memory)."""
    from nanotrain.parallel import accelerator

    acc = accelerator.of(device) if device is not None else None
    if acc is not None:
        return acc.max_memory_allocated(device) / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB  # bytes on macOS, KiB on Linux


def format_eta(seconds: Optional[float]) -> str:
    return "-" if seconds is None else str(_dt.timedelta(seconds=int(round(seconds))))


def _device_name(device) -> Optional[str]:
    from nanotrain.parallel import accelerator

    acc = accelerator.of(device) if device is not None else None
    return acc.device_name(device) or None if acc is not None else None


class MetricsLogger:
    """Scalars every `log_interval` steps from the logging rank; a no-op elsewhere.

    run_dir          the run directory (`logs/<run>/`); events go to `<run_dir>/tb/`
    config_dict      the resolved config (`config_to_dict(config)`: plain YAML), stored once as text
    enabled          True on exactly one rank: last pp stage, tp 0, dp 0 (cp 0, ep 0)
    total_steps      training.train_steps (for the progress bar and the ETA)
    tokens_per_step  global tokens per optimizer step: dp * micro_batch * accumulation * seq_len
    flops_per_token  `llama_arch.training_flops_per_token(model_args, seq_len)`: model FLOPs (MFU)
    hardware_flops_per_token  what the hardware runs (recompute adds FLOPs): `perf/hfu` is logged
                     beside `perf/mfu` when it differs from flops_per_token; None = the same
    device           torch device of this rank: selects CUDA memory stats and the GPU's name
    world_size       GPUs (processes) sharing the work: tflops_per_gpu divides by it
    device_name      overrides the detected GPU name for the MFU peak (tests; unusual GPUs)
    start_step       the step a resumed run starts after (progress bar, TensorBoard purge)
    progress_bar     tqdm bar (True) or plain lines (False); default: bar iff `stream` is a TTY
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config_dict: dict,
        enabled: bool,
        total_steps: int,
        tokens_per_step: int,
        flops_per_token: float,
        device=None,
        *,
        world_size: int = 1,
        log_interval: int = 1,
        tensorboard: bool = True,
        device_name: Optional[str] = None,
        start_step: int = 0,
        progress_bar: Optional[bool] = None,
        stream: Optional[TextIO] = None,
        hardware_flops_per_token: Optional[float] = None,
        step_time_ratio: Optional[Callable[[float, int], float]] = None,
    ):
        self.run_dir = Path(run_dir)
        # (every rank's summed step time of the interval, its steps) -> max / median over ranks
        # of the time outside waits on peers, a collective every rank joins on log steps
        # (stragglers.py); None in one process.
        self.step_time_ratio = step_time_ratio
        self.enabled = enabled
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.hardware_flops_per_token = hardware_flops_per_token
        self.device = device
        self.world_size = world_size
        self.log_interval = max(1, log_interval)
        self.device_name = device_name if device_name is not None else _device_name(device)
        self.peak_tflops = peak_bf16_tflops(self.device_name)
        self._interval_steps = 0
        self._interval_time = 0.0
        self._started = time.time()
        self._writer = None
        self._bar = None
        self._closed = False
        self._val_loss: Optional[float] = None  # the latest val/loss, for progress.json (--status)
        self._last_progress: Optional[dict] = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._stream = stream if stream is not None else sys.stdout
        if progress_bar is None:
            progress_bar = bool(getattr(self._stream, "isatty", lambda: False)())
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, file=self._stream, unit="step", dynamic_ncols=True, desc="train"
            )
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: after a resume, TensorBoard drops the events a previous incarnation
            # wrote past the checkpoint it restarts from, so curves never double back.
            self._writer = SummaryWriter(
                log_dir=str(self.run_dir / TB_DIR), purge_step=start_step + 1 if start_step else None
            )
            self._writer.add_text(CONFIG_TEXT_TAG, config_markdown(config_dict), global_step=start_step)
            self._writer.flush()

    # ------------------------------------------------------------------ per step
    def should_log(self, step: int) -> bool:
        """Same answer on every rank: use it to skip the dp loss all-reduce on silent steps."""
        return step % self.log_interval == 0 or step == self.total_steps

    def log(
        self, step: int, loss, lr: float, grad_norm, step_time_s: float, extra: Optional[dict] = None
    ) -> Optional[dict]:
        """Call after every optimizer step (1-based `step`), on every rank. On log steps of the
        logging rank writes everything and returns the metrics; otherwise returns None. `loss`
        and `grad_norm` may be 0-dim tensors; they are only read on log steps. Every rank keeps
        its interval's step times: on log steps they all join ``step_time_ratio``."""
        if self._closed:
            return None
        self._interval_steps += 1
        self._interval_time += float(step_time_s)
        if not self.should_log(step):
            return None
        if self.step_time_ratio is not None:
            ratio = self.step_time_ratio(self._interval_time, self._interval_steps)
            extra = {**(extra or {}), "perf/step_time_max_over_median": ratio}
        if not self.enabled:
            self._interval_steps, self._interval_time = 0, 0.0
            return None
        metrics = {**self._compute(step, loss, lr, grad_norm), **(extra or {})}
        self._interval_steps, self._interval_time = 0, 0.0
        self._write_tensorboard(step, metrics)
        self._write_console(step, metrics)
        # Not fsynced: this runs in the training loop on every log step, where a slow shared file
        # system would stall the step, and a crash that loses the newest progress costs nothing
        # (the next log step, or the checkpoint, says where the run is).
        self._last_progress = self._progress(step, metrics)
        atomic_write_json(self.run_dir / PROGRESS_FILE, self._last_progress, durable=False)
        return metrics

    def log_scalars(self, step: int, scalars: dict[str, float], console: str | None = None) -> None:
        """Extra scalars of the logging rank (`val/*`, `data/tokens/<source>`, ...) at `step`;
        `console`: a line printed with them (evaluations). A no-op on the other ranks."""
        if not self.enabled or self._closed:
            return
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()
        if "val/loss" in scalars:
            self._val_loss = float(scalars["val/loss"])
        if "val/loss" in scalars and self._last_progress is not None:
            # A sweep's --status table shows each point's validation loss: an evaluation that
            # follows the last log step (the final one) must reach progress.json too.
            self._last_progress = {**self._last_progress, "val_loss": self._val_loss}
            atomic_write_json(self.run_dir / PROGRESS_FILE, self._last_progress, durable=False)
        if console is not None:
            if self._bar is not None:
                self._bar.write(console, file=self._stream)
            else:
                print(console, file=self._stream, flush=True)

    def _compute(self, step: int, loss, lr, grad_norm) -> dict[str, Any]:
        step_time = self._interval_time / max(self._interval_steps, 1)
        tokens_per_sec = self.tokens_per_step / step_time if step_time > 0 else 0.0
        tflops = self.flops_per_token * tokens_per_sec / self.world_size / 1e12
        metrics: dict[str, Any] = {
            "train/loss": float(loss),
            "train/lr": float(lr),
            "train/grad_norm": None if grad_norm is None else float(grad_norm),
            "perf/tokens_per_sec": tokens_per_sec,
            "perf/tflops_per_gpu": tflops,
            "mem/peak_gb": peak_memory_gb(self.device),
        }
        if self.peak_tflops:
            metrics["perf/mfu"] = tflops / self.peak_tflops
            hardware = self.hardware_flops_per_token
            if hardware is not None and hardware != self.flops_per_token:
                metrics["perf/hfu"] = metrics["perf/mfu"] * hardware / self.flops_per_token
        metrics["step_time_s"] = step_time
        metrics["eta_s"] = (self.total_steps - step) * step_time
        return metrics

    def _write_tensorboard(self, step: int, metrics: dict) -> None:
        if self._writer is None:
            return
        for tag in SCALAR_TAGS + CROSS_RANK_TAGS:
            if metrics.get(tag) is not None:
                self._writer.add_scalar(tag, metrics[tag], global_step=step)
        self._writer.flush()  # a live `tensorboard --logdir` sees each point as it is logged

    def _write_console(self, step: int, metrics: dict) -> None:
        fields = [f"loss {metrics['train/loss']:.4f}", f"lr {metrics['train/lr']:.1e}"]
        if metrics["train/grad_norm"] is not None:
            fields.append(f"grad_norm {metrics['train/grad_norm']:.3f}")
        fields.append(f"tokens/s {metrics['perf/tokens_per_sec']:,.0f}")
        if "perf/mfu" in metrics:
            fields.append(f"mfu {100 * metrics['perf/mfu']:.1f}%")
        if "perf/hfu" in metrics:
            fields.append(f"hfu {100 * metrics['perf/hfu']:.1f}%")
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(" | ".join(fields), refresh=True)
            return
        line = " | ".join([f"step {step}/{self.total_steps}", *fields, f"ETA {format_eta(metrics['eta_s'])}"])
        print(line, file=self._stream, flush=True)

    def _progress(self, step: int, metrics: dict) -> dict:
        now = time.time()
        return {
            "step": step,
            "total_steps": self.total_steps,
            "loss": metrics["train/loss"],
            "lr": metrics["train/lr"],
            "grad_norm": metrics["train/grad_norm"],
            "tokens_per_sec": metrics["perf/tokens_per_sec"],
            "tflops_per_gpu": metrics["perf/tflops_per_gpu"],
            "mfu": metrics.get("perf/mfu"),
            "hfu": metrics.get("perf/hfu"),
            "peak_mem_gb": metrics["mem/peak_gb"],
            "step_time_s": metrics["step_time_s"],
            "eta_s": metrics["eta_s"],
            "time": now,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
            "elapsed_s": now - self._started,
            "val_loss": self._val_loss,
        }

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Flush and close the event file and the bar; safe to call twice (and on disabled ranks)."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def config_markdown(config_dict: dict) -> str:
    """The config as a Markdown code block (TensorBoard's text tab renders Markdown; indenting
    by four spaces keeps YAML's own indentation and `#`s from being read as Markdown)."""
    import yaml

    text = yaml.safe_dump(config_dict, sort_keys=False, default_flow_style=False)
    return "\n".join("    " + line for line in text.splitlines())


def is_logging_rank(parallel_context) -> bool:
    """The rank that holds the (dp-averaged) loss: last pp stage, first of tp, dp, cp and ep."""
    pc = parallel_context
    return pc.is_pipeline_last_stage and pc.tp_rank == 0 and pc.dp_rank == 0 and pc.cp_rank == 0 and pc.ep_rank == 0


def metrics_logger_for(
    config,
    run_dir,
    parallel_context=None,
    *,
    device=None,
    start_step: int = 0,
    flops: Optional[tuple[float, float]] = None,
) -> MetricsLogger:
    """The logger a trainer wants, with every number derived from the resolved config.

    `parallel_context=None` means a single process (always the logging rank). `flops`: the
    (model, hardware) FLOPs per token read from the model (``ModelFamily.flops_per_token``);
    None: the torch-free arithmetic's, which equals them (tests/test_model_twins.py)."""
    t, p = config.training, config.parallelism
    if flops is None:
        flops = (
            training_flops_per_token(config.model, t.sequence_length),
            hardware_flops_per_token(config.model, t.sequence_length, t.recompute, head_chunk_rows(config) > 0),
        )
    enabled = True if parallel_context is None else is_logging_rank(parallel_context)
    ratio = None
    if parallel_context is not None:
        from nanotrain.logging.stragglers import step_time_max_over_median  # torch: not for the CLI's imports

        watch = straggler_watch(config, run_dir, parallel_context, enabled)

        def ratio(interval_s: float, steps: int) -> float:
            return step_time_max_over_median(interval_s, steps, device, watch=watch)

    return MetricsLogger(
        run_dir,
        config_to_dict(config),
        enabled,
        total_steps=t.train_steps,
        tokens_per_step=p.batch_replicas * t.micro_batch_size * t.batch_accumulation_per_replica * t.sequence_length,
        flops_per_token=flops[0],
        device=device,
        hardware_flops_per_token=flops[1],
        world_size=p.world_size,
        log_interval=config.logging.log_interval,
        tensorboard=config.logging.tensorboard,
        start_step=start_step,
        step_time_ratio=ratio,
    )


def straggler_watch(config, run_dir, parallel_context, writer: bool):
    """The repeated-straggler watch (``stragglers.StragglerWatch``) when ``slurm.health`` is on and
    the start-up check told every rank its peers' nodes; else None."""
    from nanotrain.config.validate_slurm import health_enabled
    from nanotrain.logging.stragglers import StragglerWatch
    from nanotrain.parallel.observe.nodes import NODES

    if not health_enabled(config) or NODES.of_rank is None:
        return None
    world = parallel_context.grid.world_size
    if world == 1 or len(NODES.of_rank) != world:
        return None
    h = config.slurm.health
    stages = [parallel_context.grid.coords(r).pp for r in range(world)]
    return StragglerWatch(stages, NODES.get, h.straggler_slowdown, h.straggler_intervals, run_dir, writer)
