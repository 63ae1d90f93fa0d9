"""Random-number-generator states as uint8 tensors (safetensors holds tensors only, no pickle).

torch keeps its states as uint8 tensors already; Python's ``random`` and numpy's legacy global
generator give tuples of ints (and a float), stored as UTF-8 JSON bytes. JSON writes floats with
``repr``, which round-trips exactly, so a restore is bit-exact.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from nanotrain.checkpoint.json_bytes import from_tensor as _tensor_json
from nanotrain.checkpoint.json_bytes import to_tensor as _json_tensor


def capture_rng() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/torch_cuda/{i}"] = state
    version, internal, gauss = random.getstate()
    out["rng/python"] = _json_tensor([version, list(internal), gauss])
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out["rng/numpy"] = _json_tensor([name, keys.tolist(), int(pos), int(has_gauss), float(cached)])
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Restore what is present; returns the names of generators that could not be restored."""
    missing = []
    if "rng/torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng/torch_cpu"].clone())
    else:
        missing.append("torch_cpu")
    cuda = sorted((k for k in tensors if k.startswith("rng/torch_cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    if torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([tensors[k].clone() for k in cuda])
        elif cuda:
            missing.append(f"torch_cuda (saved {len(cuda)} devices, {torch.cuda.device_count()} visible)")
    if "rng/python" in tensors:
        version, internal, gauss = _tensor_json(tensors["rng/python"])
        random.setstate((version, tuple(internal), gauss))
    else:
        missing.append("python")
    if "rng/numpy" in tensors:
        name, keys, pos, has_gauss, cached = _tensor_json(tensors["rng/numpy"])
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    else:
        missing.append("numpy")
    return missing
