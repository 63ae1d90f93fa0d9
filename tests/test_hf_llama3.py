"""Llama 3.1 / 3.2 / 3.3 RoPE (``rope_type: llama3``, ``model.rope_scaling``) proven against
``transformers.LlamaForCausalLM`` (tiny random models built here, no download).

Two GQA models, one per RoPE shape, each with a head size, theta and factors chosen so that all
three llama3 bands hold a frequency (asserted): high frequencies kept, low ones divided by
``factor``, the smoothed band between. "llama3.2" is tied and saved by transformers 5.x
(``rope_parameters``); "llama3.1" is untied with its config.json rewritten as transformers 4.x
and the published Llama 3.1 checkpoints write it (``rope_scaling`` + a top-level ``rope_theta``).

* the frequencies: nanotrain's float64 ones are bit-identical to transformers' own llama3
  function run in float64, and equal its float32 buffer to float32 rounding;
* import (``scripts/hf_config.py`` section -> validated config -> ``load_hf_weights``): logits
  equal transformers' in float64 within 1e-10 of the largest logit; plain RoPE would miss by far more;
* tp2·pp2 (4 gloo ranks): the first-step loss equals transformers' float32 loss (rel 1e-5);
* export: a nanotrain model with llama3 scaling -> ``export_hf`` -> ``AutoModelForCausalLM``:
  config.json carries the scaling (4.x and 5.x fields), the logits agree in float64 within 1e-10;
* every bad ``model.rope_scaling`` and every HF scaling that is not llama3's: one line naming the field.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: the reference implementation
import yaml

from nanotrain.config import Config, ModelArgs, RopeScalingArgs, TrainingArgs, config_from_dict, validate
from nanotrain.hf.directory import HFError, check_hf_dir
from nanotrain.models import hf_llama
from nanotrain.models.llama import inv_frequencies

from helpers.cli import run_cli
from helpers.dist import run_distributed
from helpers.hf_ranks import first_step_losses
from helpers.hf_reference import in_float64, llama3_inv_freq_float64
from helpers.runs import ROOT, TINY

SEQ, BATCH = 64, 4  # positions 0..63: the divided low frequencies turn by visibly less
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # head_dim 16: 8 frequencies
    max_position_embeddings=128,
    initializer_range=0.1,
)
# wavelengths 2*pi*theta**(i/8): theta 10000 -> 6.3 | 19.9, 62.8 | 199 ... against 64/4 = 16 and 64/1;
# theta 500 -> 6.3, 13.7 | 29.8 | 64.9 ... against 64/4 = 16 and 64/1.5 = 42.7.
ROPE = {
    "llama3.2": dict(rope_theta=10000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original=64),
    "llama3.1": dict(rope_theta=500.0, factor=8.0, low_freq_factor=1.5, high_freq_factor=4.0, original=64),
}
TIED = {"llama3.2": True, "llama3.1": False}


def _rope_parameters(name: str) -> dict:
    r = ROPE[name]
    return {
        "rope_type": "llama3",
        "rope_theta": r["rope_theta"],
        "factor": r["factor"],
        "low_freq_factor": r["low_freq_factor"],
        "high_freq_factor": r["high_freq_factor"],
        "original_max_position_embeddings": r["original"],
    }


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-llama3")
    out = {}
    for name in ROPE:
        torch.manual_seed(5)
        cfg = transformers.LlamaConfig(**BASE, tie_word_embeddings=TIED[name], rope_parameters=_rope_parameters(name))
        hf = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("norm.weight"):  # norms away from 1, so a missed norm shows
                    p.uniform_(0.5, 1.5)
                elif n.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention: positions matter
                    p.mul_(3.0)
        hf.save_pretrained(str(root / name))
        if name == "llama3.1":  # config.json as transformers 4.x and the Llama 3.1 checkpoints write it
            path = root / name / "config.json"
            c = json.loads(path.read_text())
            params = c.pop("rope_parameters")
            c["rope_theta"] = params.pop("rope_theta")
            c["rope_scaling"] = params
            path.write_text(json.dumps(c, indent=2))
        out[name] = root / name
    return out


def _hf(path: Path):
    return transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _section(path: Path, capsys) -> dict:
    """The ``model:`` section ``scripts/hf_config.py PATH`` prints, parsed as a user's YAML is."""
    spec = importlib.util.spec_from_file_location("_script_hf_config", ROOT / "scripts" / "hf_config.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(path)]) == 0
    return yaml.safe_load(capsys.readouterr().out)["model"]


def _args(section: dict, **changes) -> ModelArgs:
    """The validated ``model`` of a config holding ``section`` (float32, sequences of SEQ)."""
    config = config_from_dict({"model": {**section, "dtype": "float32", **changes}})
    config.training = TrainingArgs(sequence_length=SEQ)
    validate(config)
    return config.model


def _nanotrain(args: ModelArgs, hf_dir: Path | None = None, seed: int = 0):
    from nanotrain.hf.import_weights import load_hf_weights
    from nanotrain.models.llama_parallelize import build_llama

    model = build_llama(args, None, seed=seed)
    if hf_dir is not None:
        load_hf_weights(hf_dir, model, args)
    return model.eval()


@pytest.mark.parametrize("name", list(ROPE))
def test_every_band_holds_a_frequency_and_nanotrain_computes_transformers_frequencies(name, hf_dirs):
    hf, r = _hf(hf_dirs[name]), ROPE[name]
    reference = llama3_inv_freq_float64(hf.config)
    d = BASE["hidden_size"] // BASE["num_attention_heads"]
    plain = 1.0 / (r["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    wavelength = 2 * math.pi / plain
    kept = wavelength < r["original"] / r["high_freq_factor"]
    divided = wavelength > r["original"] / r["low_freq_factor"]
    smoothed = ~kept & ~divided
    assert kept.any() and divided.any() and smoothed.any(), wavelength
    assert torch.equal(reference[kept], plain[kept])
    assert torch.equal(reference[divided], plain[divided] / r["factor"])
    assert bool(((reference[smoothed] > plain[smoothed] / r["factor"]) & (reference[smoothed] < plain[smoothed])).all())

    scaling = RopeScalingArgs(
        factor=r["factor"],
        low_freq_factor=r["low_freq_factor"],
        high_freq_factor=r["high_freq_factor"],
        original_max_position_embeddings=r["original"],
    )
    mine = inv_frequencies(d, r["rope_theta"], scaling)
    assert mine.dtype == torch.float64 and torch.equal(mine, reference)
    shipped = hf.model.rotary_emb.inv_freq  # transformers' own float32 computation
    assert shipped.dtype == torch.float32 and torch.allclose(shipped.double(), mine, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(ROPE))
def test_import_logits_equal_transformers_in_float64(name, hf_dirs, capsys):
    section = _section(hf_dirs[name], capsys)
    r = ROPE[name]
    assert section["rope_theta"] == r["rope_theta"] and section["tie_word_embeddings"] is TIED[name]
    assert section["rope_scaling"] == {
        "type": "llama3",
        "factor": r["factor"],
        "low_freq_factor": r["low_freq_factor"],
        "high_freq_factor": r["high_freq_factor"],
        "original_max_position_embeddings": r["original"],
    }
    args = _args(section)
    ids = _ids()[:, :-1]
    with torch.no_grad():
        hf = _hf(hf_dirs[name])
        ref = in_float64(hf, llama3_inv_freq_float64(hf.config))(ids).logits
        mine = _nanotrain(args, hf_dirs[name]).double()
        got = mine(ids).transpose(0, 1)
        unscaled = _nanotrain(_args(section, rope_scaling=None)).double()  # the same weights, plain RoPE
        unscaled.load_state_dict(mine.state_dict())
        plain = unscaled(ids).transpose(0, 1)
    scale = ref.abs().max().item()
    worst = (got - ref).abs().max().item()
    print(f"{name}: float64 worst |logit difference| {worst:.3g} (largest logit {scale:.3g})")
    assert worst <= 1e-10 * scale
    assert (plain - ref).abs().max().item() > 1e-3 * scale  # the comparison sees the scaling


def test_tp2_pp2_first_step_loss_equals_transformers(hf_dirs):
    ids = _ids()
    models = {}
    for name in ROPE:
        cfg = json.loads((hf_dirs[name] / "config.json").read_text())
        section = hf_llama.model_section(cfg)
        section["rope_scaling"] = RopeScalingArgs(**section["rope_scaling"])
        models[name] = section
    layout = dict(tp=2, pp=2)
    losses = run_distributed(first_step_losses, 4, hf_dirs, [layout], None, models, ids, timeout=300)[0]
    for name in ROPE:
        with torch.no_grad():
            logits = _hf(hf_dirs[name])(ids[:, :-1]).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
        got = losses[(str(layout), name)]
        print(f"{name}: tp2 pp2 float32 loss {got!r}, transformers {ref!r}, rel {abs(got - ref) / ref:.3g}")
        assert got == pytest.approx(ref, rel=1e-5), (name, got, ref)


def test_export_round_trip_keeps_the_scaling(tmp_path):
    from safetensors.torch import load_file

    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.hf.export import export_hf

    r = ROPE["llama3.2"]
    scaling = {"factor": r["factor"], "low_freq_factor": r["low_freq_factor"], "high_freq_factor": 4.0}
    section = {
        **{k: v for k, v in BASE.items() if k not in ("num_hidden_layers", "initializer_range")},
        "num_layers": BASE["num_hidden_layers"],
        "rope_theta": r["rope_theta"],
        "tie_word_embeddings": True,
        "init_std": 0.1,
        "rope_scaling": {**scaling, "original_max_position_embeddings": r["original"]},
    }
    args = _args(section)
    mine = _nanotrain(args, seed=9)
    with torch.no_grad():  # sharp attention, as the imported models have
        for n, p in mine.named_parameters():
            if n.endswith("attn.qkv.weight"):
                p[: (4 + 2) * 16].mul_(3.0)  # the rows [q | k] of 4 query and 2 kv heads of 16
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, mine, config=Config(model=args))
    export_hf(ckpt, tmp_path / "out")

    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    want = {"rope_type": "llama3", **scaling, "original_max_position_embeddings": r["original"]}
    assert cfg["rope_scaling"] == want and cfg["rope_parameters"] == {**want, "rope_theta": r["rope_theta"]}
    assert hf_llama.model_section(cfg)["rope_scaling"] == {"type": "llama3", **section["rope_scaling"]}
    assert hf_llama.mismatches(args, cfg) == [] and hf_llama.unsupported(cfg) == []
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert hf.config.rope_parameters == {**want, "rope_theta": r["rope_theta"]}
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))
    assert hf.config.tie_word_embeddings
    ids = _ids()[:, :-1]
    with torch.no_grad():
        ref32 = mine(ids).transpose(0, 1)
        got32 = hf(ids).logits  # transformers as shipped: its float32 RoPE and RMSNorm
        assert torch.allclose(got32, ref32, rtol=1e-4, atol=1e-4 * ref32.abs().max().item())
        ref = mine.double()(ids).transpose(0, 1)
        got = in_float64(hf, llama3_inv_freq_float64(hf.config))(ids).logits
    worst = (got - ref).abs().max().item()
    print(f"export: float64 worst |logit difference| {worst:.3g} (largest logit {ref.abs().max().item():.3g})")
    assert worst <= 1e-10 * ref.abs().max().item()


SCALING = "model.rope_scaling.original_max_position_embeddings=128"  # below tiny_cpu's 256
BAD_SETS = [
    ("unknown-type", ["model.rope_scaling.type=yarn", SCALING], ["model.rope_scaling.type", "'llama3'", "remove"]),
    ("factor-below-1", ["model.rope_scaling.factor=0.5", SCALING], ["model.rope_scaling.factor", "minimum 1.0"]),
    ("low-zero", ["model.rope_scaling.low_freq_factor=0", SCALING], ["model.rope_scaling.low_freq_factor", "above 0"]),
    (
        "high-negative",
        ["model.rope_scaling.high_freq_factor=-4", SCALING],
        ["model.rope_scaling.high_freq_factor", "above 0"],
    ),
    (
        "low-not-below-high",
        ["model.rope_scaling.low_freq_factor=4", "model.rope_scaling.high_freq_factor=4", SCALING],
        ["model.rope_scaling.low_freq_factor (4.0) must be below high_freq_factor (4.0)"],
    ),
    (
        "original-not-below-max",
        ["model.rope_scaling.factor=8"],
        ["model.rope_scaling.original_max_position_embeddings (8192)", "below model.max_position_embeddings (256)"],
    ),
    ("unknown-key", ["model.rope_scaling.factr=8"], ["model.rope_scaling", "did you mean 'factor'"]),
    ("not-a-mapping", ["model.rope_scaling=llama3"], ["model.rope_scaling", "expected a mapping"]),
]


@pytest.mark.parametrize("sets, fragments", [c[1:] for c in BAD_SETS], ids=[c[0] for c in BAD_SETS])
def test_bad_rope_scaling_is_one_error_line(sets, fragments, tmp_path, capsys):
    from helpers.cli import dry_run_error_line  # the command line: imported here, not by every rank

    line = dry_run_error_line(TINY, sets, tmp_path, capsys)
    for fragment in fragments:
        assert fragment in line, (fragment, line)


def test_good_rope_scaling_passes_the_dry_run(tmp_path, capsys):
    code, _, err = run_cli([TINY, "--dry-run", "--set", f"logging.dir={tmp_path}", "--set", SCALING], capsys)
    assert code == 0, err


def _edited(path: Path, edit) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    return cfg


def test_hf_scalings_nanotrain_cannot_compute_and_mismatches_are_one_line(hf_dirs, tmp_path):
    v4 = hf_dirs["llama3.1"]  # rope_scaling (4.x form)

    def scaling(**fields):
        return lambda c: c["rope_scaling"].update(fields)

    for edit, fragments in [
        (scaling(rope_type="yarn"), ["rope scaling 'yarn'", "'llama3'"]),
        (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), ["rope scaling 'linear'"]),
        (lambda c: c["rope_scaling"].pop("low_freq_factor"), ["'llama3': low_freq_factor is None"]),
        (scaling(original_max_position_embeddings=64.5), ["original_max_position_embeddings is 64.5"]),
        (lambda c: c.update(original_max_position_embeddings=32), ["32 at the top of config.json but 64"]),
    ]:
        problems = hf_llama.unsupported(_edited(v4, edit))
        assert len(problems) == 1 and "\n" not in problems[0], problems
        assert all(f in problems[0] for f in fragments), (fragments, problems)

    args = _args(hf_llama.model_section(_edited(v4, lambda c: None)))
    plain = replace(args, rope_scaling=None)
    for model, cfg, fragments in [
        (plain, _edited(v4, lambda c: None), ["model.rope_scaling is absent", "set model.rope_scaling: {type: llama3"]),
        (
            args,
            _edited(v4, lambda c: c.pop("rope_scaling")),
            ["config.json has plain RoPE", "remove model.rope_scaling"],
        ),
        (
            args,
            _edited(v4, scaling(factor=16.0)),
            ["model.rope_scaling.factor is 8.0 but config.json has factor 16.0", "set model.rope_scaling.factor: 16.0"],
        ),
    ]:
        problems = hf_llama.mismatches(model, cfg)
        assert len(problems) == 1 and "\n" not in problems[0], problems
        assert all(f in problems[0] for f in fragments), (fragments, problems)

    # The pre-launch check of checkpoints.init_from_hf says the same, on one line.
    with pytest.raises(HFError) as err:
        check_hf_dir(v4, plain)
    assert "\n" not in str(err.value) and "model.rope_scaling is absent" in str(err.value)
