"""Metrics: TensorBoard tags read back with tensorboard's own reader, a live `tensorboard` server
listing them over HTTP, console output, progress.json, and the FLOP/parameter counts against a
hand count and the real model."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from nanotrain.config import ModelArgs, load_config
from nanotrain.logging import SCALAR_TAGS, MetricsLogger, metrics_logger_for, peak_bf16_tflops
from nanotrain.models.llama_arch import attention_flops_per_token, parameter_count, training_flops_per_token
from nanotrain.models.llama_parallelize_costs import hardware_flops_per_token

TOKENS_PER_STEP = 4 * 2 * 3 * 64  # dp 4 x micro-batch 2 x accumulation 3 x seq 64
FLOPS_PER_TOKEN = 3.0e9
WORLD = 8
STEP_TIME = 0.25
LOSSES = {1: 5.5, 2: 5.0, 3: 4.6, 4: 4.1, 5: 3.9}
CPU_TAGS = set(SCALAR_TAGS) - {"perf/mfu", "perf/hfu"}


def write_steps(run_dir, stream=None, **kwargs) -> list:
    logger = MetricsLogger(
        run_dir,
        {"model": {"hidden_size": 64}, "optimizer": {"betas": (0.9, 0.95)}},
        True,
        total_steps=5,
        tokens_per_step=TOKENS_PER_STEP,
        flops_per_token=FLOPS_PER_TOKEN,
        device="cpu",
        world_size=WORLD,
        log_interval=2,
        stream=stream or io.StringIO(),
        **kwargs,
    )
    written = [logger.log(step, LOSSES[step], 1e-3 * step, 0.5 + step, STEP_TIME) for step in LOSSES]
    logger.close()
    return written


def read_events(tb_dir):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_tags_on_cpu(tmp_path):
    out = io.StringIO()
    written = write_steps(tmp_path, stream=out)
    assert [w is not None for w in written] == [False, True, False, True, True]  # interval 2 + last
    acc = read_events(tmp_path / "tb")
    assert set(acc.Tags()["scalars"]) == CPU_TAGS  # exactly these; perf/mfu absent on CPU
    for tag in CPU_TAGS:
        assert [e.step for e in acc.Scalars(tag)] == [2, 4, 5], tag
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([5.0, 4.1, 3.9])
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([2e-3, 4e-3, 5e-3])
    assert [e.value for e in acc.Scalars("train/grad_norm")] == pytest.approx([2.5, 4.5, 5.5])
    tokens_per_sec = TOKENS_PER_STEP / STEP_TIME
    assert acc.Scalars("perf/tokens_per_sec")[0].value == pytest.approx(tokens_per_sec)
    assert acc.Scalars("perf/tflops_per_gpu")[0].value == pytest.approx(FLOPS_PER_TOKEN * tokens_per_sec / WORLD / 1e12)
    assert 0.01 < acc.Scalars("mem/peak_gb")[0].value < 64  # this process's peak RSS, GiB

    texts = [t for t in acc.Tags()["tensors"] if t.startswith("config")]
    assert texts == ["config/text_summary"]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "hidden_size: 64" in text and "- 0.95" in text

    lines = out.getvalue().splitlines()
    assert lines == [
        "step 2/5 | loss 5.0000 | lr 2.0e-03 | grad_norm 2.500 | tokens/s 6,144 | ETA 0:00:01",
        "step 4/5 | loss 4.1000 | lr 4.0e-03 | grad_norm 4.500 | tokens/s 6,144 | ETA 0:00:00",
        "step 5/5 | loss 3.9000 | lr 5.0e-03 | grad_norm 5.500 | tokens/s 6,144 | ETA 0:00:00",
    ]
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["step"] == 5 and progress["total_steps"] == 5
    assert progress["loss"] == pytest.approx(3.9) and progress["lr"] == pytest.approx(5e-3)
    assert progress["tokens_per_sec"] == pytest.approx(tokens_per_sec)
    assert progress["eta_s"] == 0 and progress["mfu"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic: no leftovers


def test_progress_carries_the_latest_val_loss(tmp_path):
    """A sweep's --status table reads val loss from progress.json: an evaluation after the last
    log step reaches it too, and a later log step keeps it."""
    logger = MetricsLogger(
        tmp_path, {}, True, total_steps=4, tokens_per_step=8, flops_per_token=1.0, device="cpu", log_interval=2
    )
    progress = lambda: json.loads((tmp_path / "progress.json").read_text())  # noqa: E731
    logger.log(2, 5.0, 1e-3, 1.0, STEP_TIME)
    assert progress()["val_loss"] is None
    logger.log_scalars(2, {"val/loss": 4.5, "val/ppl": 90.0})
    assert progress()["val_loss"] == pytest.approx(4.5) and progress()["step"] == 2
    logger.log(4, 4.0, 1e-3, 1.0, STEP_TIME)
    assert progress()["val_loss"] == pytest.approx(4.5) and progress()["step"] == 4
    logger.close()


def test_mfu_present_for_a_known_gpu(tmp_path):
    write_steps(tmp_path, device_name="NVIDIA H100 80GB HBM3")
    acc = read_events(tmp_path / "tb")
    assert set(acc.Tags()["scalars"]) == set(SCALAR_TAGS) - {"perf/hfu"}  # no recompute: HFU = MFU, not logged
    tflops = acc.Scalars("perf/tflops_per_gpu")[0].value
    assert acc.Scalars("perf/mfu")[0].value == pytest.approx(tflops / 989.0)


def test_hfu_beside_mfu_when_recompute_adds_flops(tmp_path):
    """recompute: full runs one more forward of the layers: HFU counts it, MFU does not."""
    args = ModelArgs(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_attention_heads=4)
    model = training_flops_per_token(args, 64)
    full = hardware_flops_per_token(args, 64, "full")
    head = 6 * parameter_count(args).embedding  # untied head: 6 V H, not recomputed
    assert full - model == (model - head) // 3  # the layers' forward: a third of their training FLOPs
    assert model < hardware_flops_per_token(args, 64, "selective") < full
    assert hardware_flops_per_token(args, 64, "none") == model
    out = io.StringIO()
    write_steps(
        tmp_path, stream=out, device_name="NVIDIA H100 80GB HBM3", hardware_flops_per_token=FLOPS_PER_TOKEN * 1.3
    )
    acc = read_events(tmp_path / "tb")
    assert set(acc.Tags()["scalars"]) == set(SCALAR_TAGS)
    assert acc.Scalars("perf/hfu")[0].value == pytest.approx(1.3 * acc.Scalars("perf/mfu")[0].value)
    assert "| hfu " in out.getvalue()


def test_progress_bar_when_interactive(tmp_path):
    out = io.StringIO()
    write_steps(tmp_path, stream=out, progress_bar=True)
    text = out.getvalue()
    assert "5/5" in text and "loss 3.9000" in text and "tokens/s 6,144" in text
    assert "step 2/5 |" not in text  # bar, not the plain log lines


def test_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    """A run that logged to step 4 and resumes from a step-2 checkpoint must not show 3 and 4
    twice: the new writer's purge_step makes TensorBoard drop the stale points."""
    for start, losses in ((0, {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}), (2, {3: 97.0, 4: 96.0, 5: 95.0})):
        logger = MetricsLogger(
            tmp_path,
            {},
            True,
            total_steps=5,
            tokens_per_step=10,
            flops_per_token=1.0,
            start_step=start,
            stream=io.StringIO(),
        )
        for step, loss in losses.items():
            logger.log(step, loss, 1e-3, 1.0, 0.1)
        logger.close()
        # Event files are read in name order, and names start with the whole second of their
        # creation: a real restart is a later process; here wait for the next second.
        time.sleep(1.01 - time.time() % 1.0)
    points = [(e.step, e.value) for e in read_events(tmp_path / "tb").Scalars("train/loss")]
    assert points == [(1, 9.0), (2, 8.0), (3, 97.0), (4, 96.0), (5, 95.0)]


def test_disabled_rank_writes_nothing(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(
        tmp_path / "run", {}, False, total_steps=3, tokens_per_step=1, flops_per_token=1.0, stream=out
    )
    assert all(logger.log(s, 1.0, 1e-3, 1.0, 0.1) is None for s in (1, 2, 3))
    assert logger.should_log(3)
    logger.close()
    assert not (tmp_path / "run").exists() and out.getvalue() == ""


def test_logger_from_config(tmp_path):
    config = load_config("configs/tiny_cpu.yaml")
    logger = metrics_logger_for(config, tmp_path)
    t, p = config.training, config.parallelism
    assert logger.tokens_per_step == p.dp * t.micro_batch_size * t.batch_accumulation_per_replica * t.sequence_length
    assert logger.world_size == p.world_size and logger.total_steps == t.train_steps
    assert logger.flops_per_token == training_flops_per_token(config.model, t.sequence_length)
    logger.close()


# ---------------------------------------------------------------------------- FLOPs / params
SMALL = dict(
    vocab_size=259,
    hidden_size=48,
    intermediate_size=136,
    num_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def test_flops_hand_count():
    args = ModelArgs(**SMALL)
    # head_dim 8; q 48, k and v 2 heads x 8 = 16 each.
    qkv, o_proj, mlp = 48 * (48 + 16 + 16), 48 * 48, 3 * 48 * 136
    assert (qkv, o_proj, mlp) == (3840, 2304, 19584)
    per_layer = qkv + o_proj + mlp  # 25,728
    matmul = 3 * per_layer + 259 * 48  # layers + LM head = 77,184 + 12,432
    assert parameter_count(args).matmul == matmul == 89_616
    assert attention_flops_per_token(args, 32) == 12 * 3 * 48 * 32 == 55_296
    assert training_flops_per_token(args, 32) == 6 * 89_616 + 55_296 == 592_992
    tied = ModelArgs(**{**SMALL, "tie_word_embeddings": True})
    assert training_flops_per_token(tied, 32) == 592_992  # the tied head still does its matmul
    assert parameter_count(tied).total == parameter_count(args).total - 259 * 48


def test_flops_of_the_1b_config():
    config = load_config("configs/3d_16gpu.yaml")
    counts = parameter_count(config.model)
    assert counts.total == 1_100_048_384  # TinyLlama-1.1B
    assert training_flops_per_token(config.model, 2048) == 6 * 1_034_420_224 + 12 * 22 * 2048 * 2048


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_the_model(tied):
    from nanotrain.models.llama_parallelize import build_llama

    args = ModelArgs(**{**SMALL, "tie_word_embeddings": tied})
    model = build_llama(args, None)  # no process group: tp = 1
    assert parameter_count(args).total == sum(p.numel() for p in model.parameters())


def test_peak_table():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA H200") == 989.0
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == peak_bf16_tflops("NVIDIA A100 80GB PCIe") == 312.0
    assert peak_bf16_tflops("NVIDIA B200") == 2250.0
    assert peak_bf16_tflops("NVIDIA L40S") == 362.0 and peak_bf16_tflops("NVIDIA L4") == 121.0
    assert peak_bf16_tflops("NVIDIA A10") == 125.0
    for unknown in (None, "", "cpu", "Tesla V100-SXM2-32GB", "Some Future GPU"):
        assert peak_bf16_tflops(unknown) is None


# ---------------------------------------------------------------------------- live server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


def test_tensorboard_server_lists_the_scalars(tmp_path):
    logdir = tmp_path / "logs"
    write_steps(logdir / "myrun")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline, tags, last_error = time.monotonic() + 90, {}, None
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"tensorboard exited {server.returncode}: {server.stdout.read().decode()[-2000:]}")
            try:
                tags = _get_json(f"{base}/data/plugin/scalars/tags")
                if "myrun/tb" in tags and len(tags["myrun/tb"]) == len(CPU_TAGS):
                    break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
                last_error = exc
            time.sleep(0.5)
        else:
            pytest.fail(f"tensorboard never listed the run: tags={tags} last error={last_error}")
        assert set(tags["myrun/tb"]) == CPU_TAGS
        query = urllib.parse.urlencode({"run": "myrun/tb", "tag": "train/loss"})
        points = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")  # [wall_time, step, value]
        assert [p[1] for p in points] == [2, 4, 5]
        assert [p[2] for p in points] == pytest.approx([5.0, 4.1, 3.9])
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)
        server.stdout.close()
