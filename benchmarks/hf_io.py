"""Time and peak memory of the Hugging Face export and import, for a ~100M and a ~1B-shaped model.

    .venv/bin/python benchmarks/hf_io.py [--sizes 100m,1b] [--families llama,qwen3,...] [--dtype float32|bfloat16]
                                         [--workdir DIR]

For each size: a random nanotrain model (one process) is saved as a checkpoint, then — each in a
fresh process, so that its peak RSS (``ru_maxrss``) is its own — ``export_hf`` writes the HF
directory, and ``load_hf_weights`` fills a freshly built (1,1,1) model from it. The import's
peak includes the model itself (fp32 parameters), so the table shows both. No PyTorch-native
equivalent exists (transformers' ``save_pretrained`` needs the whole model in memory, which is
the thing export avoids), so there is no ratio column.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {  # (hidden, intermediate, layers, heads, kv heads, vocab)
    "100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_attention_heads=32,  # TinyLlama
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}


# What each dense family adds to the shape (its options on): the tensors it maps differ.
FAMILY_OPTIONS = {
    "llama": {},
    "mistral": dict(sliding_window=4096),
    "qwen2": dict(qkv_bias=True, tie_word_embeddings=True),
    "qwen3": dict(qk_norm=True, head_dim=128, tie_word_embeddings=True),  # q/k/v wider than hidden
    "smollm3": dict(no_rope_layers=[3, 7, 11, 15, 19], tie_word_embeddings=True),
}


def _args(size: str, family: str = "llama"):
    from nanotrain.config import config_from_dict

    model = {**SIZES[size], "max_position_embeddings": 2048, "dtype": "float32", "family": family}
    return config_from_dict({"model": {**model, **FAMILY_OPTIONS[family]}}).model


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def prepare(size: str, family: str, ckpt_root: str) -> dict:
    import torch

    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.config import Config
    from nanotrain.models.llama_parallelize import build_llama

    torch.manual_seed(0)
    config = Config()
    config.model = _args(size, family)
    t0 = time.perf_counter()
    model = build_llama(config.model, None)
    save_checkpoint(ckpt_root, 1, model, None, None, None, extra={"consumed_samples": 0}, config=config)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "seconds": time.perf_counter() - t0}


def export(ckpt_root: str, out: str, dtype: str) -> dict:
    from nanotrain.hf.export import export_hf

    result = export_hf(ckpt_root, out, dtype)
    return {"seconds": result["seconds"], "bytes": result["bytes"], "peak_mb": _peak_mb()}


def import_(size: str, family: str, hf_dir: str) -> dict:
    from nanotrain.hf.import_weights import load_hf_weights
    from nanotrain.models.llama_parallelize import build_llama

    args = _args(size, family)
    model = build_llama(args, None)
    before = _peak_mb()
    result = load_hf_weights(hf_dir, model, args)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {
        "seconds": result["seconds"],
        "bytes": result["bytes"],
        "peak_mb": _peak_mb(),
        "peak_before_load_mb": before,
        "model_mb": model_mb,
    }


def _child(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{argv[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        fn = {"_prepare": prepare, "_export": export, "_import": import_}[sys.argv[1]]
        print(json.dumps(fn(*sys.argv[2:])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100m,1b")
    parser.add_argument("--families", default="llama", help=f"of {', '.join(FAMILY_OPTIONS)}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hf_io-"))
    rows = []
    try:
        for size, family in [(s, f) for s in args.sizes.split(",") for f in args.families.split(",")]:
            ckpt, out = work / f"{size}-{family}-ckpt", work / f"{size}-{family}-hf"
            made = _child("_prepare", size, family, str(ckpt))
            exp = _child("_export", str(ckpt), str(out), args.dtype)
            imp = _child("_import", size, family, str(out))
            rows.append((f"{size} {family}", made["params"], exp, imp))
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"| model | params | export {args.dtype} s | export MB written | export peak RSS MB | import s | "
        "import peak RSS MB | of which the model's fp32 parameters MB | RSS before the load MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, params, exp, imp in rows:
        print(
            f"| {size} | {params / 1e6:.1f} M | {exp['seconds']:.1f} | {exp['bytes'] / 1e6:.0f} | "
            f"{exp['peak_mb']:.0f} | {imp['seconds']:.1f} | {imp['peak_mb']:.0f} | {imp['model_mb']:.0f} | "
            f"{imp['peak_before_load_mb']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
