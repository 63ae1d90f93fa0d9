"""Run metrics: model FLOPs and GPU peaks (`flops`), TensorBoard/console/progress.json (`metrics`).

Named `nanotrain.logging`, it shadows nothing: absolute imports (`import logging`) still get the
standard library inside this package.
"""
from nanotrain.logging.flops import (
                                     ParamCount,
                                     attention_flops_per_token,
                                     parameter_count,
                                     peak_bf16_tflops,
                                     training_flops_per_token,
)
from nanotrain.logging.metrics import (
                                     PROGRESS_FILE,
                                     SCALAR_TAGS,
                                     TB_DIR,
                                     MetricsLogger,
                                     is_logging_rank,
                                     metrics_logger_for,
)

__all__ = ["MetricsLogger", "ParamCount", "PROGRESS_FILE", "SCALAR_TAGS", "TB_DIR",
           "attention_flops_per_token", "is_logging_rank", "metrics_logger_for", "parameter_count",
           "peak_bf16_tflops", "training_flops_per_token"]
