"""Every bad ``checkpoints.init_from_hf`` is refused before anything is submitted: exit 2, one
``error:`` line per problem naming both values, no traceback (``submit.py --dry-run``, which runs
the same pre-launch checks as a launch). The HF directories are written here with safetensors and
JSON (no transformers needed); tests/test_hf.py proves the mapping against transformers itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from nanotrain.commands.cli import main
from nanotrain.config import ModelArgs
from nanotrain.models import hf_llama

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
# configs/tiny_cpu.yaml's model section
TINY_MODEL = ModelArgs(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=256,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)


def write_hf(path: Path, config_edit=None, tensor_edit=None, args: ModelArgs = TINY_MODEL) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_llama.hf_config(args, dtype="bfloat16", bos_token_id=0, eos_token_id=0)
    del cfg["rope_parameters"]  # a transformers 4.x style config.json
    if config_edit:
        config_edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in hf_llama.hf_shapes(args).items()}
    if tensor_edit:
        tensor_edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def dry_run(tmp_path: Path, hf: Path, *sets: str, capsys) -> tuple[int, str, str]:
    argv = [
        str(TINY),
        "--dry-run",
        "--set",
        f"logging.dir={tmp_path / 'logs'}",
        "--set",
        f"checkpoints.init_from_hf={hf}",
    ]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _arch(c):
    c.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096)


BAD = [
    # (id, config edit, tensor edit, fragments of the one error line)
    (
        "another-family",
        _arch,
        None,
        ["holds a mistral model (MistralForCausalLM)", "model.family is llama", "set model.family: mistral"],
    ),
    (
        "unknown-model-type",
        lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
        None,
        ["model_type 'gpt2'", "nanotrain imports llama (LlamaForCausalLM)", "qwen3_moe (Qwen3MoeForCausalLM)"],
    ),
    (
        "rope-scaling",
        lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 8.0}),
        None,
        ["rope scaling 'yarn'", "plain RoPE and rope_type 'llama3'"],
    ),
    ("attention-bias", lambda c: c.update(attention_bias=True), None, ["attention_bias: true", "no bias"]),
    (
        "bias-tensor",
        None,
        lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
        ["bias tensors present", "model.layers.0.self_attn.q_proj.bias"],
    ),
    (
        "missing-tensor",
        None,
        lambda t: t.pop("model.layers.2.mlp.up_proj.weight"),
        ["tensor missing", "model.layers.2.mlp.up_proj.weight"],
    ),
    (
        "shape-mismatch",
        None,
        lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)}),
        ["model.layers.1.self_attn.k_proj.weight has shape [64, 64]", "needs [32, 64]"],
    ),
    (
        "vocab-larger",
        lambda c: c.update(vocab_size=300),
        None,
        ["model.vocab_size (256) is smaller than", "vocab_size 300", "set model.vocab_size: 300"],
    ),
    (
        "field-mismatch",
        lambda c: c.update(rms_norm_eps=1e-6),
        None,
        ["model.rms_norm_eps is 1e-05 but config.json has rms_norm_eps 1e-06", "set model.rms_norm_eps: 1.0e-06"],
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_hf_dir_is_one_error_line(case, tmp_path, capsys):
    _, config_edit, tensor_edit, fragments = case
    hf = write_hf(tmp_path / "hf", config_edit, tensor_edit)
    code, out, err = dry_run(tmp_path, hf, capsys=capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not (tmp_path / "logs").exists()  # nothing made, nothing submitted


def test_missing_dir_and_no_weights(tmp_path, capsys):
    code, _, err = dry_run(tmp_path, tmp_path / "nope", capsys=capsys)
    assert code == 2 and err.count("error:") == 1 and "is not a directory" in err, err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(
        json.dumps(hf_llama.hf_config(TINY_MODEL, dtype="float32", bos_token_id=0, eos_token_id=0))
    )
    code, _, err = dry_run(tmp_path, tmp_path / "empty", capsys=capsys)
    assert code == 2 and err.count("error:") == 1 and "neither model.safetensors nor" in err, err


def test_every_mismatch_is_named_on_the_one_line(tmp_path, capsys):
    hf = write_hf(tmp_path / "hf", lambda c: c.update(rope_theta=500000.0, rms_norm_eps=1e-6))
    code, _, err = dry_run(tmp_path, hf, capsys=capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: model."), err
    assert "rope_theta 500000.0" in lines[0] and "; model." in lines[0] and "rms_norm_eps 1e-06" in lines[0], err
    # hf_config.py prints the section that fixes them: with it the same directory passes.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "hf_config.py"), str(hf)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    section = yaml.safe_load(proc.stdout)
    assert section["checkpoints"]["init_from_hf"] == str(hf.resolve())
    assert section["model"]["rms_norm_eps"] == 1e-6  # a float, not the string '1e-06'
    sets = [f"model.{k}={json.dumps(v)}" for k, v in section["model"].items()]
    code, out, err = dry_run(tmp_path, hf, *sets, capsys=capsys)
    assert code == 0, err


def test_index_sharded_dir_is_read(tmp_path):
    """A directory of model-0000k-of-0000n files + index passes the same checks (headers only)."""
    from nanotrain.hf.directory import check_hf_dir

    single = write_hf(tmp_path / "one")
    tensors = load_file(str(single / "model.safetensors"))
    names = sorted(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    sharded = tmp_path / "two"
    sharded.mkdir()
    (sharded / "config.json").write_text((single / "config.json").read_text())
    weight_map = {}
    for k, part in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf = check_hf_dir(sharded, TINY_MODEL)
    assert {r["file"] for r in hf.tensors.values()} == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }


def test_product_never_imports_transformers():
    """Export and import use safetensors and JSON only (transformers is a dev dependency)."""
    code = (
        "import sys; import nanotrain.hf.export, nanotrain.hf.import_weights, "
        "nanotrain.commands.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
