"""Run metrics: GPU peaks (`flops`), TensorBoard/console/progress.json (`metrics`); the model
FLOPs behind MFU are `nanotrain.models.llama_arch`'s.

Named `nanotrain.logging`, it shadows nothing: absolute imports (`import logging`) still get the
standard library inside this package.
"""

from nanotrain.logging.flops import peak_bf16_tflops
from nanotrain.logging.metrics import (
    PROGRESS_FILE,
    SCALAR_TAGS,
    TB_DIR,
    MetricsLogger,
    is_logging_rank,
    metrics_logger_for,
)

__all__ = [
    "MetricsLogger",
    "PROGRESS_FILE",
    "SCALAR_TAGS",
    "TB_DIR",
    "is_logging_rank",
    "metrics_logger_for",
    "peak_bf16_tflops",
]
