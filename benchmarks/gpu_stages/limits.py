"""The numbers and names every stage of the GPU check shares: the budget and each stage's cap
(so that a rerun fits a 15-minute lease), the models of the GPU run and of --cpu-smoke, the
packages the trainer needs. Kept apart so a cap is changed in one place."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THIS = str(ROOT / "benchmarks" / "gpu_trainer_check.py")  # the entry point: its --task runs one trainer run
PY = sys.executable

BUDGET_S = 290.0  # under 5 minutes: a rerun fits a 15-minute lease with the machine's start-ups
CAPS_S = {
    "versions": 30,
    "gpu-tests": 75,
    "trainer": 150,
    "multi-gpu": 120,
    "flight-recorder": 30,
    "rehearsal": 30,
    "masked-attention": 90,
    "bench": 150,
}
MASKED_MIN_S = 45.0  # less left than this for the masked-attention stage: skipped (two flex compiles)
RUN_CAP_S = 60.0  # one trainer run (the compiled one: COMPILE_CAP_S)
COMPILE_CAP_S = 90.0
MIN_STAGE_S = 5.0  # less left than this: the stage is skipped, not started
PASSING = ("passed", "skipped", "unavailable")
NOISE_FACTOR = 10.0  # a resumed loss may differ by this times two fresh runs' difference (nondeterminism)
COMPILE_STEPS = 3
COMPILE_REL_TOL = 0.02
SMOKE_CACHE_DOCS = 50  # --cpu-smoke: documents tokenised both ways and compared byte for byte

GPU_MODEL = dict(
    vocab_size=256,
    hidden_size=1024,
    intermediate_size=4096,
    num_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    dtype="bfloat16",
)  # 0.18 B parameters
CPU_MODEL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    dtype="bfloat16",
)
REQUIRED = ("torch", "numpy", "yaml", "safetensors", "tensorboard", "submitit", "cloudpickle", "pytest")
OPTIONAL = ("datasets", "transformers")
SINGLE_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
