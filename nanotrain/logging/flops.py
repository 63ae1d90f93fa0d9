"""GPU peak throughput: the denominator of MFU; and what the numerator counts of masked attention.

The numerator, model FLOPs per token, is a property of the model and lives with its other
arithmetic: ``nanotrain.models.llama_arch.training_flops_per_token`` (PaLM convention).
``attention_accounting`` is the one sentence --dry-run, --plan and a run's first lines print
under document masking about it and the memory estimate.
"""

from __future__ import annotations

import re
from typing import Optional

from nanotrain.config import Config
from nanotrain.config.schema_model import attention_kernel_on

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets, matched
# against `torch.cuda.get_device_name()`. Order matters: the first pattern that matches wins, so
# variants (H100 PCIe, GH200, L40S) come before the names they contain (H100, H200, L40).
_PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    (r"GB200", 2500.0),
    (r"B200", 2250.0),
    (r"B100", 1750.0),
    (r"GH200", 989.0),
    (r"H200.*NVL", 835.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|H800", 989.0),  # SXM ("NVIDIA H100 80GB HBM3") and H800
    (r"A100|A800", 312.0),  # SXM and PCIe have the same tensor peak
    (r"A30\b", 165.0),
    (r"A40\b", 149.7),
    (r"A10\b", 125.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"RTX 4090", 165.2),
    (r"RTX 3090", 71.0),
    (r"MI325X|MI300X", 1307.4),
    (r"MI250X", 383.0),
]


def peak_bf16_tflops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak of one GPU, or None for a CPU, an unknown GPU, or one without bf16 (V100):
    an MFU against a guessed peak would be worse than none."""
    if not device_name:
        return None
    for pattern, tflops in _PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops
    return None


def attention_accounting(config: Config, cuda: bool | None = None, layout: bool = True) -> list[str]:
    """The line that says, under ``data.document_masking``, which kernel runs and what the memory
    estimate and the FLOP counter (MFU) count for attention: the same words in --dry-run, --plan
    and a run's first lines. ``cuda``: where it runs (default: a GPU unless
    ``slurm.gpus_per_node`` is 0); ``layout`` False (--plan, whose proposals differ in cp and
    micro-batch): no mask size."""
    if not config.data.document_masking:
        return []
    cuda = config.slurm.gpus_per_node != 0 if cuda is None else cuda
    kernel = attention_kernel_on(config.model, cuda)
    if kernel == "flex":
        memory = "memory as causal attention's (FlexAttention's tile lists are negligible)"
    else:
        t = config.training
        size = (
            f": {t.micro_batch_size * t.sequence_length**2 / config.parallelism.cp / 2**20:,.4g} MiB" if layout else ""
        )
        memory = (
            f"memory adds the materialised mask (micro_batch_size x S/cp x S bytes per micro-batch in flight{size})"
        )
    return [
        f"document masking: attention kernel {kernel} (model.attention_kernel {config.model.attention_kernel}); "
        f"{memory}; FLOPs (MFU) count the full S x S attention, an upper bound of the causal and of the "
        "masked work, which depends on the document lengths"
    ]
