"""Hugging Face in and out, proven against ``transformers.LlamaForCausalLM`` (no download: tiny
random HF models are built here and saved once per session).

* import at (1,1,1), dp2·tp2, dp2·pp2, cp2·tp2 and dp2·tp2·pp2, for a GQA + untied and an MHA +
  tied model: nanotrain's first-step loss on a fixed batch equals HF's loss on it (fp32, rel 1e-5);
* export after training 3 steps at dp2·tp2·pp2 with ZeRO-1: HF's logits equal nanotrain's on the
  same ids (fp32 rel 1e-4, float64 1e-10); a sharded export (tiny shard size) loads with
  ``from_pretrained`` and holds the same tensors; the exported byte tokenizer encodes to the
  training ids;
* the product path (``submit.py --local`` with ``checkpoints.init_from_hf`` at tp2·pp2, lr 0, then
  a restart without the HF directory, which resumes from the run's own checkpoint) exported again
  is bit-identical to the HF source, tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: the reference implementation

from nanotrain.config import ModelArgs

from helpers.dist import run_distributed
from helpers.hf_ranks import GQA, LAYOUT8, LAYOUTS4, MHA, batch, first_step_losses
from helpers.hf_reference import in_float64
from helpers.runs import ROOT, TINY, cli


def hf_config(model: dict):
    keys = dict(model)
    keys["num_hidden_layers"] = keys.pop("num_layers")
    return transformers.LlamaConfig(**keys)


def hf_loss(path: Path, ids: torch.Tensor) -> float:
    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, model in (("gqa", GQA), ("mha", MHA)):
        torch.manual_seed(11)
        hf = transformers.LlamaForCausalLM(hf_config(model))
        with torch.no_grad():  # norms away from 1, so a missed norm shows
            for n, p in hf.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        hf.save_pretrained(str(root / name))
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def trained_checkpoint(hf_dirs, tmp_path_factory) -> tuple[Path, dict]:
    """The 8-rank launch: first-step losses at dp2·tp2·pp2 and the GQA model trained and saved."""
    root = tmp_path_factory.mktemp("hf-trained")
    losses = run_distributed(first_step_losses, 8, hf_dirs, [LAYOUT8], str(root / "checkpoints"), timeout=400)
    return root / "checkpoints", losses[0]


def test_import_first_step_loss_equals_hf(hf_dirs, trained_checkpoint):
    from nanotrain.hf.import_weights import load_hf_weights
    from nanotrain.models.llama_parallelize import build_llama

    ids = batch()
    losses = dict(trained_checkpoint[1])
    losses.update(run_distributed(first_step_losses, 4, hf_dirs, LAYOUTS4, None, timeout=400)[0])
    for name, model in (("gqa", GQA), ("mha", MHA)):
        args = ModelArgs(**model, dtype="float32")
        single = build_llama(args, None)
        load_hf_weights(hf_dirs[name], single, args)
        with torch.no_grad():
            losses[("single", name)] = single(ids[:, :-1], ids[:, 1:]).item()
        ref = hf_loss(hf_dirs[name], ids)
        for layout in ["single", *map(str, LAYOUTS4), str(LAYOUT8)]:
            got = losses[(layout, name)]
            assert got == pytest.approx(ref, rel=1e-5), (name, layout, got, ref)


def test_export_after_3d_zero1_training_matches_nanotrain_logits(hf_dirs, trained_checkpoint, tmp_path):
    from nanotrain.checkpoint import load_checkpoint
    from nanotrain.data.tokenizer import ByteTokenizer
    from nanotrain.hf.export import export_hf, parse_size
    from nanotrain.models.llama_parallelize import build_llama

    ckpts, _ = trained_checkpoint
    out, sharded = tmp_path / "out", tmp_path / "sharded"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(ckpts), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    export_hf(ckpts, sharded, max_shard_size=parse_size("60KB"))
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and not (sharded / "model.safetensors").exists()

    args = ModelArgs(**GQA, dtype="float32")
    mine = build_llama(args, None)
    load_checkpoint(ckpts, mine)
    ids = batch()[:, :-1]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out))
    hf_sharded = transformers.LlamaForCausalLM.from_pretrained(str(sharded))
    state, state_sharded = hf.state_dict(), hf_sharded.state_dict()
    assert state.keys() == state_sharded.keys()
    assert all(torch.equal(state[k], state_sharded[k]) for k in state)
    with torch.no_grad():
        ref = mine(ids).transpose(0, 1)
        got = hf(ids).logits
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        ref64 = mine.double()(ids).transpose(0, 1)
        got64 = in_float64(hf)(ids).logits
    assert (got64 - ref64).abs().max().item() <= 1e-10 * ref64.abs().max().item()
    # The export holds the trained weights, not the HF initialisation.
    initial = transformers.LlamaForCausalLM.from_pretrained(str(hf_dirs["gqa"])).state_dict()
    assert not torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"], initial["model.layers.0.self_attn.q_proj.weight"]
    )

    text = "def f(x):\n\treturn x  # héllo wörld ✓ \x00 \x7f"
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.encode(text) == ByteTokenizer().encode_batch([text])[0].tolist()
    assert tok.decode(tok.encode(text)) == text
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (0, False, 500000.0)


def _submit(run: Path, *sets: str, timeout: float = 400) -> str:
    args = [str(TINY), "--local", "--set", f"logging.dir={run.parent}", "--set", f"logging.run_name={run.name}"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_submit_init_from_hf_lr0_round_trip_is_bit_identical(hf_dirs, tmp_path):
    from safetensors.torch import load_file

    from nanotrain.models import hf_llama

    hf_copy = tmp_path / "mha-hf"
    shutil.copytree(hf_dirs["mha"], hf_copy)
    section = hf_llama.model_section(json.loads((hf_copy / "config.json").read_text()))
    sets = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in section.items()]
    sets += [
        "parallelism.dp=1",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "training.sequence_length=32",
        "training.batch_accumulation_per_replica=2",
        "optimizer.lr=0",
        "optimizer.min_lr=0",
        "optimizer.warmup_steps=0",
        "checkpoints.interval=0",
        f"checkpoints.init_from_hf={hf_copy}",
    ]
    data = tmp_path / "data.txt"  # a small local text: no tokenising of the standard library per run
    data.write_text((ROOT / "README.md").read_text()[:20000])
    sets.append(f"data.source={data}")
    run = tmp_path / "logs" / "rt"
    out = _submit(run, *sets, "training.train_steps=2")
    assert "initialised from Hugging Face" in out, out
    hf_copy.rename(tmp_path / "gone")  # a restart resumes from the run's checkpoint, not from HF
    out = _submit(run, *sets, "training.train_steps=3")
    assert "resumed from" in out and "initialised from Hugging Face" not in out, out
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(run), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "x" / "nanotrain_export.json").read_text())["step"] == 3
    source, exported = (
        load_file(str(tmp_path / "gone" / "model.safetensors")),
        load_file(str(tmp_path / "x" / "model.safetensors")),
    )
    source.pop("lm_head.weight", None)  # tied: HF may store the head beside the embedding
    assert source.keys() == exported.keys()
    for k in source:
        assert source[k].dtype == exported[k].dtype and torch.equal(source[k], exported[k]), k
