"""Document-masked attention against plain causal attention: tokens/s and peak activation bytes.

    .venv/bin/python benchmarks/masked_attention.py                  # CPU, S = 2048 and 8192
    .venv/bin/python benchmarks/masked_attention.py --seq 2048       # one length
    python benchmarks/masked_attention.py --gpu-check --out R.json   # CUDA (gpu_check.sh's stage)

One attention layer's kernel (B = 1, 8 heads of 64, float32 on the CPU) over a window packed with
documents of 64 to 2047 tokens (seeded), each row in a fresh process:
* ``causal``: SDPA ``is_causal`` (what runs without document masking);
* ``sdpa_mask``: SDPA under the materialised boolean mask, built inside the step as the model
  builds it (``model.attention_kernel: sdpa_mask``, the CPU's training path);
* ``flex``: compiled FlexAttention under the block mask (``model.attention_kernel: flex``), block
  mask built inside the step. The CPU has its forward only (torch has no FlexAttention backward
  there), so it is compared with causal's forward: rows ``fwd`` are forward only (no grad), rows
  ``fwd+bwd`` a forward and a backward.
Peak activation bytes: the process's resident high-water mark during the timed steps above its
resident size before them (``/proc/self/clear_refs`` resets the mark; glibc's mmap threshold is
fixed at 64 KiB so that every large buffer is mapped while it lives and unmapped when freed).
``benchmarks/memory.py``'s dispatch-mode counter cannot see the buffers a compiled kernel
allocates, so this one measure serves every row. Inputs (q, k, v, the document ids) are
allocated before and not counted. Criterion (the fast path): flex's peak at most 1.1 x causal's
at S >= 8192.

``--gpu-check``: on CUDA, compiled FlexAttention forward and backward (float32, S = 2048, GQA 8/2
heads; the whole window and a cp2 rank's zig-zag queries through ``ContextParallel.attention``)
against the CPU reference (SDPA under the materialised mask, float64): output and gradients
within 1e-4 of each one's largest entry;
then bf16 at S = 8192: tokens/s of a forward + backward and ``max_memory_allocated`` above the
inputs for causal, sdpa_mask and flex. ``--eager-flex`` (gpu_check's --cpu-smoke) runs that logic
on the CPU, forward only, with eager FlexAttention (no compile).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanotrain.parallel import sdpa as sdpa_module  # noqa: E402
from nanotrain.parallel.context_parallel import ContextParallel, cp_positions  # noqa: E402
from nanotrain.parallel.cp_balance import packed_documents  # noqa: E402
from nanotrain.parallel.documents import document_attention  # noqa: E402
from nanotrain.parallel.sdpa import masked_sdpa, sdpa  # noqa: E402

HEADS, HEAD_DIM = 8, 64
# flex in float32 against the float64 reference, relative to each tensor's largest entry: float32
# rounding over 2048-key sums stays near 1e-6; a wrong mask entry moves outputs by O(1).
FLOAT32_TOLERANCE = 1e-4
ROWS = [("causal", "fwd+bwd"), ("sdpa_mask", "fwd+bwd"), ("causal", "fwd"), ("sdpa_mask", "fwd"), ("flex", "fwd")]


def documents_of(seq: int, device="cpu") -> torch.Tensor:
    """``[1, seq]`` document ids of a window packed with documents of 64..2047 tokens (seeded)."""
    lengths = np.random.default_rng(0).integers(64, 2048, size=seq // 64 + 1)
    return torch.as_tensor(packed_documents(lengths, seq), device=device)[None]


def step_fn(kernel: str, grad: bool, q, k, v, documents):
    """One attention step of ``kernel`` (its mask built inside, as the model builds it per
    micro-batch), with a backward when ``grad``."""

    def attend():
        if kernel == "causal":
            return sdpa(q, k, v, is_causal=True)
        return masked_sdpa(q, k, v, document_attention(documents, kernel=kernel)[1])

    def step():
        if grad:
            out = attend()
            out.backward(torch.ones_like(out))
            for t in (q, k, v):
                t.grad = None
        else:
            with torch.no_grad():
                attend()

    return step


def _resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def measure_row(kernel: str, mode: str, seq: int, steps: int) -> dict:
    """One row in this process: tokens/s (median step) and the resident peak above the inputs."""
    torch.manual_seed(0)
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, requires_grad=grad) for _ in "qkv")
    step = step_fn(kernel, grad, q, k, v, documents_of(seq))
    step()  # warm-up: compiles flex, touches the allocator's first pages
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    base, _ = _resident()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    _, peak = _resident()
    return {
        "kernel": kernel,
        "mode": mode,
        "seq": seq,
        "tokens_per_s": round(seq / float(np.median(times))),
        "peak_bytes": peak - base,
    }


def run_rows(seqs: list[int], steps: int) -> list[dict]:
    """Every (S, row) in a fresh process (its own resident peak), fixed mmap threshold."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    rows = []
    for seq in seqs:
        for kernel, mode in ROWS:
            cmd = [sys.executable, __file__, "--row", kernel, mode, str(seq), "--steps", str(steps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    speed, peak = f"{r['tokens_per_s']:>9,} tokens/s", f"{r['peak_bytes'] / 2**20:8.1f} MiB"
    return f"S {r['seq']:>5}  {r['kernel']:<9} {r['mode']:<7}  {speed}  {peak}"


def verdict(rows: list[dict]) -> tuple[list[str], bool]:
    """Per S: each masked row's peak and speed over causal's in the same mode; the criterion."""
    lines, ok = [], True
    for r in rows:
        if r["kernel"] == "causal":
            continue
        base = next(c for c in rows if c["kernel"] == "causal" and c["seq"] == r["seq"] and c["mode"] == r["mode"])
        ratio = r["peak_bytes"] / max(base["peak_bytes"], 1)
        lines.append(
            f"S {r['seq']}: {r['kernel']} {r['mode']} peak {ratio:.2f} x causal's, "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} x its tokens/s"
        )
        if r["kernel"] == "flex" and r["seq"] >= 8192:
            ok = ok and ratio <= 1.1
    return lines + [f"criterion (flex peak <= 1.1 x causal's at S >= 8192): {'met' if ok else 'NOT met'}"], ok


# ----------------------------------------------------------------------------- --gpu-check
def _attend_grads(kernel: str, q, k, v, documents, queries=None, cp_rank=None):
    """(output, dq, dk, dv) of the masked attention of ``queries`` (a cp2 rank's, or all)."""
    q, k, v = (t.detach().requires_grad_(torch.is_grad_enabled()) for t in (q, k, v))
    _, mask = document_attention(documents, queries, kernel=kernel)
    rows = q if queries is None else q[:, :, queries]
    if cp_rank is None:
        out = masked_sdpa(rows, k, v, mask)
    else:
        cp = ContextParallel(None)
        cp.size, cp.rank = 2, cp_rank
        out = cp.attention(rows, k, v, mask)
    if torch.is_grad_enabled():
        out.backward(torch.cos(torch.arange(out.numel(), device=out.device, dtype=out.dtype)).view_as(out))
        return [out.detach()] + [t.grad for t in (q, k, v)]
    return [out.detach()]


def gpu_check(eager: bool) -> dict:
    """Flex on the device against the CPU reference, then the S = 8192 timings (module doc)."""
    device = torch.device("cpu" if eager else "cuda")
    if eager:  # the smoke: FlexAttention uncompiled, forward only (the CPU has no backward)
        sdpa_module._FLEX[:] = [sdpa_module.flex_attention]  # flex_kernel() returns it
    seq, result = (256 if eager else 2048), {"device": str(device), "compare": {}}
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, seq, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, seq, 64, generator=gen, dtype=torch.float64) for _ in "kv")
    documents = documents_of(seq) // 2 if eager else documents_of(seq)  # the smoke: fewer, longer documents
    worst = 0.0
    for name, queries, rank in (("window", None, None), ("cp2-rank1", cp_positions(seq, 2, 1), 1)):
        with torch.set_grad_enabled(not eager):
            want = _attend_grads("sdpa_mask", q, k, v, documents, queries, rank)
            got = _attend_grads(
                "flex",
                *(t.to(device, torch.float32) for t in (q, k, v)),
                documents.to(device),
                None if queries is None else queries.to(device),
                rank,
            )
        errors = [((g.double().cpu() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
        result["compare"][name] = errors
        worst = max(worst, *errors)
    result["max_relative_error"], result["ok"] = worst, worst <= FLOAT32_TOLERANCE
    if eager:
        return result
    seq, timings = 8192, {}
    docs = documents_of(seq, device)
    for kernel in ("causal", "sdpa_mask", "flex"):
        torch.cuda.empty_cache()
        qq, kk, vv = (
            torch.randn(1, 16, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
        )
        step = step_fn(kernel, True, qq, kk, vv, docs)
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / 5
        timings[kernel] = {
            "tokens_per_s": round(seq / seconds),
            "peak_bytes": torch.cuda.max_memory_allocated() - base,
        }
    result["s8192_bf16_16x128"] = timings
    result["flex_peak_over_causal"] = round(timings["flex"]["peak_bytes"] / timings["causal"]["peak_bytes"], 3)
    result["ok"] = result["ok"] and result["flex_peak_over_causal"] <= 1.1
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--row", nargs=3, metavar=("KERNEL", "MODE", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--gpu-check", action="store_true", help="CUDA: flex vs the CPU reference, S = 8192 timings")
    parser.add_argument("--eager-flex", action="store_true", help="--gpu-check's logic on the CPU (smoke)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    opts = parser.parse_args()
    if opts.row:
        kernel, mode, seq = opts.row
        print(json.dumps(measure_row(kernel, mode, int(seq), opts.steps)))
        return 0
    if opts.gpu_check or opts.eager_flex:
        result = gpu_check(opts.eager_flex)
        print(json.dumps(result, indent=1))
    else:
        rows = run_rows(opts.seq, opts.steps)
        lines, ok = verdict(rows)
        print("\n".join(lines))
        result = {"rows": rows, "verdict": lines, "ok": ok}
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
