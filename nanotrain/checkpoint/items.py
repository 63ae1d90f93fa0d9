"""What a rank has to checkpoint, read from the live objects: parameters with their ShardInfo,
the optimizer state per parameter name in the one layout of ZeRO-0 and ZeRO-1, and the
random-number generators' states.

The RNG states are uint8 tensors (safetensors holds tensors only, no pickle): torch keeps its
states as uint8 tensors already; Python's ``random`` and numpy's legacy global generator give
tuples of ints (and a float), stored as UTF-8 JSON bytes. JSON writes floats with ``repr``, which
round-trips exactly, so a restore is bit-exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch
from torch import nn

from nanotrain.checkpoint.comm import json_from_tensor, json_to_tensor
from nanotrain.optim.optimizer import optimizer_state_by_name
from nanotrain.parallel.data_parallel.zero import ZeroOneOptimizer

Models = Union[nn.Module, Sequence[nn.Module]]


def named_params(model: Models) -> dict[str, list[nn.Parameter]]:
    """Name -> the parameters of that name on this rank (several modules, e.g. virtual pipeline
    chunks, may be passed; a name found twice with different tensors is filled in both)."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    out: dict[str, list[nn.Parameter]] = {}
    for m in modules:
        for name, p in m.named_parameters():
            lst = out.setdefault(name, [])
            if all(q is not p for q in lst):
                lst.append(p)
    return out


@dataclass
class OptEntry:
    name: str
    start: int
    stop: int
    local_shape: tuple[int, ...]
    step: torch.Tensor
    exp_avg: torch.Tensor  # 1-D, stop - start elements
    exp_avg_sq: torch.Tensor


def optimizer_entries(optimizer) -> dict[str, OptEntry]:
    out = {}
    for name, s in optimizer_state_by_name(optimizer).items():
        out[name] = OptEntry(
            name,
            int(s["start"]),
            int(s["stop"]),
            tuple(s["shape"]),
            torch.as_tensor(s["step"], dtype=torch.float32).reshape(1),
            s["exp_avg"].reshape(-1),
            s["exp_avg_sq"].reshape(-1),
        )
    return out


@dataclass
class OptSlot:
    """Where this rank's optimizer state of one parameter goes: [start, stop) of the flattened
    local parameter of shape ``local_shape``."""

    start: int
    stop: int
    local_shape: tuple[int, ...]


def optimizer_layout(optimizer) -> dict[str, OptSlot]:
    """The layout ``load_optimizer_state_by_name`` expects, read without touching (or allocating)
    any state: a fresh optimizer has none yet."""
    if isinstance(optimizer, ZeroOneOptimizer):
        return {pc.name: OptSlot(pc.start, pc.stop, tuple(pc.param.shape)) for pc in optimizer.pieces}
    return {
        name: OptSlot(0, p.numel(), tuple(p.shape))
        for group in optimizer.param_groups
        for name, p in zip(group["param_names"], group["params"])
    }


def zero_stage_of(optimizer) -> int | None:
    if optimizer is None:
        return None
    return optimizer.stage if isinstance(optimizer, ZeroOneOptimizer) else 0


def config_as_dict(config) -> dict | None:
    """A Config dataclass or an already plain dict -> plain JSON-able dict (None stays None)."""
    if config is None or isinstance(config, dict):
        return config
    from nanotrain.config import config_to_dict

    return config_to_dict(config)


def topology_of(pc, optimizer=None, config: dict | None = None) -> dict:
    par = (config or {}).get("parallelism") or {}
    sizes = (
        {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
        if pc is None
        else {"dp": pc.dp_size, "tp": pc.tp_size, "pp": pc.pp_size, "cp": pc.cp_size, "ep": pc.ep_size}
    )
    return {
        **sizes,
        "zero_stage": zero_stage_of(optimizer),
        "pp_engine": par.get("pp_engine"),
        "pp_virtual_stages": par.get("pp_virtual_stages"),
        "tp_mode": par.get("tp_mode"),
    }


GRID_AXES = ("dp", "tp", "pp", "cp", "ep")


def same_grid(a: dict, b: dict) -> bool:
    return all(a.get(k, 1) == b.get(k, 1) for k in GRID_AXES)


def coords_of(pc) -> dict[str, int]:
    if pc is None:
        return {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}
    return {"pp": pc.pp_rank, "dp": pc.dp_rank, "cp": pc.cp_rank, "tp": pc.tp_rank, "ep": pc.ep_rank}


# ------------------------------------------------------------------------- RNG states


def capture_rng() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/torch_cuda/{i}"] = state
    version, internal, gauss = random.getstate()
    out["rng/python"] = json_to_tensor([version, list(internal), gauss])
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out["rng/numpy"] = json_to_tensor([name, keys.tolist(), int(pos), int(has_gauss), float(cached)])
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
        version, internal, gauss = json_from_tensor(tensors["rng/python"])
        random.setstate((version, tuple(internal), gauss))
    else:
        missing.append("python")
    if "rng/numpy" in tensors:
        name, keys, pos, has_gauss, cached = json_from_tensor(tensors["rng/numpy"])
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    else:
        missing.append("numpy")
    return missing
