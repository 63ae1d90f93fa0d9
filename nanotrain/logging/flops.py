"""GPU peak throughput: the denominator of MFU.

The numerator, model FLOPs per token, is a property of the model and lives with its other
arithmetic: ``nanotrain.models.llama_arch.training_flops_per_token`` (PaLM convention).
"""

from __future__ import annotations

import re
from typing import Optional

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
