"""Merging saved shards into full tensors and cutting a rank's piece back out, by the slice
metadata every shard carries: what lets a checkpoint written at one (dp, tp, pp, cp, ZeRO stage)
load at another (``load.py`` on a live model, ``reshard.py`` offline)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint.format import CheckpointError, info_from_json


class ShardReader:
    """Lazily opened safetensors files of one checkpoint (memory-mapped, read per tensor)."""

    def __init__(self, ckpt: Path):
        self.ckpt, self.handles = ckpt, {}

    def get(self, rel: str, key: str) -> torch.Tensor:
        return self.get_handle(rel).get_tensor(key)

    def get_handle(self, rel: str):
        if rel not in self.handles:
            self.handles[rel] = safe_open(str(self.ckpt / rel), framework="pt")
        return self.handles[rel]

    def close(self) -> None:
        self.handles.clear()


def _by_stage(entries: list[dict]) -> list[list[dict]]:
    """Entries grouped by the pipeline stage that wrote them. A parameter lives on one stage,
    except a tied embedding's replica on the last stage: its ZeRO-1 ranges differ from the
    original's (other neighbours in the flat buffer), so both are saved; any one complete group
    rebuilds the tensor, the first stage's is used."""
    groups: dict[int, list[dict]] = {}
    for e in entries:
        groups.setdefault(e.get("stage", 0), []).append(e)
    return [groups[k] for k in sorted(groups)]


def _place(full: torch.Tensor, covered: torch.Tensor, local: torch.Tensor, shard_json: dict) -> None:
    for loc, glob in info_from_json(shard_json).pairs:
        full[glob] = local[loc]
        covered[glob] = True


def cut_local(full: torch.Tensor, shard_json: dict, local_shape) -> torch.Tensor:
    """A rank's local tensor (padding zero) from the full one, by its slice pairs."""
    local = torch.zeros(tuple(local_shape), dtype=full.dtype)
    for loc, glob in info_from_json(shard_json).pairs:
        local[loc] = full[glob]
    return local


def assemble_full(reader: ShardReader, name: str, entries: list[dict]) -> torch.Tensor:
    """The unsharded tensor from saved shards (every element covered, replicas agreeing)."""
    shape = entries[0]["shard"]["global_shape"]
    dtype = fmt.DTYPES[entries[0]["dtype"]]
    for group in _by_stage(entries):
        full, covered = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=torch.bool)
        for e in group:
            _place(full, covered, reader.get(e["file"], e["key"]), e["shard"])
        if bool(covered.all()):
            return full
    raise CheckpointError(f"{name}: the saved shards do not cover the whole tensor {shape}")


def assemble_optimizer_full(reader: ShardReader, name: str, entries: list[dict]) -> dict[str, torch.Tensor]:
    """Full exp_avg / exp_avg_sq (unsharded shape) and step from the saved ranges: for each saved
    local shard, its dp ranges (ZeRO-1) are concatenated back into the flattened local tensor,
    which is then placed like a parameter shard."""
    shape = entries[0]["shard"]["global_shape"]
    dtype = fmt.DTYPES[entries[0]["dtype"]]
    for group in _by_stage(entries):
        out = {k: torch.zeros(shape, dtype=dtype) for k in ("exp_avg", "exp_avg_sq")}
        covered, steps = torch.zeros(shape, dtype=torch.bool), set()
        shards: dict[str, list[dict]] = {}
        for e in group:
            shards.setdefault(fmt.canonical([e["shard"], e["local_shape"]]), []).append(e)
        complete = True
        for parts in shards.values():
            local_shape, numel = parts[0]["local_shape"], math.prod(parts[0]["local_shape"])
            spans = sorted({(e["start"], e["stop"]) for e in parts})
            if spans[0][0] != 0 or spans[-1][1] != numel or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
                complete = False  # some dp range of this shard is missing
                break
            for k in ("exp_avg", "exp_avg_sq"):
                flat = torch.zeros(numel, dtype=dtype)
                for e in parts:
                    flat[e["start"] : e["stop"]] = reader.get(e["file"], f"{e['prefix']}/{k}")
                _place(out[k], covered, flat.view(local_shape), parts[0]["shard"])
            steps.update(float(reader.get(e["file"], f"{e['prefix']}/step").item()) for e in parts)
        if not complete or not bool(covered.all()):
            continue
        if len(steps) != 1:
            raise CheckpointError(f"{name}: saved optimizer shards disagree on the step count: {sorted(steps)}")
        out["step"] = torch.tensor(steps.pop(), dtype=torch.float32)
        return out
    raise CheckpointError(f"{name}: the saved optimizer ranges do not cover the whole tensor {shape}")
