"""Shard files: how parameters and AdamW states are grouped into safetensors files and indexed,
and how a rank's files are written together.

Split from ``format`` (names, checksums, commit primitives) because this is the one part that
knows what a model or optimizer shard holds. Writes go through ``fmt.write_safetensors`` looked
up at call time, so a test can interpose on every checkpoint write in one place.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.parallel.sharding import ShardInfo

WRITE_THREADS = 4  # files of one rank written at once (each also hashes on its own thread)


def model_shard_files(
    tag: str, items: list[tuple[str, torch.Tensor, ShardInfo]], granularity: str = "rank", stage: int = 0
) -> tuple[dict, dict]:
    """Parameter shards as files to write: ({rel: (tensors, header)}, index {name: [entry]}).

    ``items``: (name, local tensor, ShardInfo). Each entry records the file, the unsharded shape,
    the (local, global) slice pairs, the local shape and dtype: enough to rebuild the full tensor
    from any set of shards and to recognise a shard that a new rank can take as it is."""
    groups = _group(items, granularity, lambda name: f"model/{name}/{tag}.safetensors", f"model/{tag}.safetensors")
    jobs, index = {}, {}
    for rel, group in groups.items():
        header, tensors = {}, {}
        for name, tensor, info in group:
            entry = {
                "shard": fmt.info_to_json(info),
                "local_shape": list(tensor.shape),
                "dtype": fmt.dtype_name(tensor.dtype),
            }
            header[name] = entry
            tensors[name] = tensor
            index.setdefault(name, []).append({"file": rel, "key": name, "stage": stage, **entry})
        jobs[rel] = (tensors, {"kind": "model", "tensors": header})
    return jobs, index


def optimizer_shard_files(tag: str, items: list[tuple], granularity: str = "rank", stage: int = 0) -> tuple[dict, dict]:
    """AdamW states as files to write. ``items``: (name, ShardInfo, local_shape, start, stop, step,
    exp_avg, exp_avg_sq): the states of elements [start, stop) of the flattened LOCAL parameter
    (ZeRO-1 ranges; [0, numel) for ZeRO-0), whose pieces map to the full tensor through the ShardInfo."""
    groups = _group(
        items, granularity, lambda name: f"optimizer/{name}/{tag}.safetensors", f"optimizer/{tag}.safetensors"
    )
    jobs, index = {}, {}
    for rel, group in groups.items():
        header, tensors = {}, {}
        for name, info, local_shape, start, stop, step, exp_avg, exp_avg_sq in group:
            entry = {
                "shard": fmt.info_to_json(info),
                "local_shape": list(local_shape),
                "start": int(start),
                "stop": int(stop),
                "dtype": fmt.dtype_name(exp_avg.dtype),
            }
            header[name] = entry
            tensors[f"{name}/exp_avg"] = exp_avg.reshape(-1)
            tensors[f"{name}/exp_avg_sq"] = exp_avg_sq.reshape(-1)
            tensors[f"{name}/step"] = torch.as_tensor(step, dtype=torch.float32).reshape(1)
            index.setdefault(name, []).append({"file": rel, "prefix": name, "stage": stage, **entry})
        jobs[rel] = (tensors, {"kind": "optimizer", "tensors": header})
    return jobs, index


def write_files(ckpt_dir: Path, jobs: dict[str, tuple[dict, dict]]) -> dict[str, dict]:
    """Write ``{rel: (tensors, header)}`` under ``ckpt_dir``, up to ``WRITE_THREADS`` files at
    once; returns ``{rel: meta.json record}`` once every file is durable (fsynced).

    Concurrent files overlap one file's fsync (waiting on the disk) with the next one's writing
    and hashing (CPU): one at a time, a save paid the sum. The first failure is raised after
    every started write has ended, so no thread still writes into a directory being cleaned."""
    if not jobs:
        return {}
    with ThreadPoolExecutor(min(WRITE_THREADS, len(jobs)), thread_name_prefix="nanotrain-ckpt-file") as pool:
        futures = {
            rel: pool.submit(fmt.write_safetensors, ckpt_dir / rel, tensors, header)
            for rel, (tensors, header) in jobs.items()
        }
    return {rel: future.result() for rel, future in futures.items()}


def write_model_shards(
    ckpt_dir: Path,
    tag: str,
    items: list[tuple[str, torch.Tensor, ShardInfo]],
    granularity: str = "rank",
    stage: int = 0,
) -> tuple[dict, dict]:
    """``model_shard_files`` written: (files {rel: record}, index)."""
    jobs, index = model_shard_files(tag, items, granularity, stage)
    return write_files(ckpt_dir, jobs), index


def write_optimizer_shards(
    ckpt_dir: Path, tag: str, items: list[tuple], granularity: str = "rank", stage: int = 0
) -> tuple[dict, dict]:
    """``optimizer_shard_files`` written: (files {rel: record}, index)."""
    jobs, index = optimizer_shard_files(tag, items, granularity, stage)
    return write_files(ckpt_dir, jobs), index


def _group(items, granularity, per_param, per_rank) -> dict[str, list]:
    if granularity not in ("rank", "param"):
        raise ValueError(f"granularity must be 'rank' or 'param', got {granularity!r}")
    groups: dict[str, list] = {}
    for item in items:
        rel = per_param(item[0]) if granularity == "param" else per_rank
        groups.setdefault(rel, []).append(item)
    return groups


def merge_index(into: dict, part: dict) -> None:
    for name, entries in part.items():
        into.setdefault(name, []).extend(entries)
