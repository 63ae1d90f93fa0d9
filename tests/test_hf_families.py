"""Mistral, Qwen2/2.5, Qwen3, SmolLM3, Mixtral and Qwen3-MoE in and out, proven against
``transformers`` (tiny random models of each family made and saved here: tests/helpers/hf_families.py).

* one process, float64: the ``model:`` section ``scripts/hf_config.py DIR`` prints, validated,
  imported by ``load_hf_weights``, gives transformers' logits within 1e-10 of the largest logit
  (transformers' own float32 casts run in float64: ``helpers.hf_reference.in_float64``);
* one 8-rank launch for all families (``helpers.hf_family_ranks.family_runs``): dense families at
  tp2 x pp2 x cp2, the MoE ones at tp2 x pp2 x ep2 and tp2 x cp2 x ep2; the gathered float32
  logits within 1e-5 of transformers' largest logit, the first-step loss and grad norm within
  1e-5 relative (auxiliary MoE loss off: transformers leaves it out of its loss), two lr-0 steps
  alike (``make test-full``: three more layouts per family: sequence parallelism, afab, dp with
  async tp; dp and cp beside ep);
* the checkpoint each tp2 run saved, exported: every tensor bit-identical to the source
  directory's, none added or missing, ``AutoModelForCausalLM`` builds the family's class from it
  with nothing missing, unexpected or mismatched;
* a directory of one family refused for a config of another, before launch, naming both;
* trained: Qwen3 at dp2 x tp2 x pp2 and Qwen3-MoE at tp2 x pp2 x ep2, 50 steps (AdamW, ZeRO-1,
  clipping, weight decay) on Python source bytes, exported: transformers' loss on held-out source
  equals nanotrain's own evaluation of the same checkpoint (``training.evaluate``) within 1%.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nanotrain.config import config_from_dict, validate
from nanotrain.hf.directory import HFError, check_hf_dir

from helpers.dist import run_distributed
from helpers.hf_families import FAMILIES, MOE, load, make_hf_dir
from helpers.hf_family_ranks import family_runs, train_and_evaluate
from helpers.hf_reference import in_float64
from helpers.runs import ROOT

SEQ, BATCH = 32, 4
DENSE_LAYOUT = dict(tp=2, pp=2, cp=2)
MOE_LAYOUTS = {"tp2pp2ep2": dict(tp=2, pp=2, ep=2), "tp2cp2ep2": dict(tp=2, cp=2, ep=2)}
RUNS = {
    f"{name}@{key}": (name, layout)
    for name in FAMILIES
    for key, layout in (MOE_LAYOUTS.items() if name in MOE else [("tp2pp2cp2", DENSE_LAYOUT)])
}


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(4))


def _script():
    spec = importlib.util.spec_from_file_location("_script_hf_config", ROOT / "scripts" / "hf_config.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def section_of(path: Path) -> dict:
    """The ``model:`` section ``scripts/hf_config.py PATH`` prints, parsed as a user's YAML is."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _script().main([str(path)]) == 0
    return yaml.safe_load(out.getvalue())["model"]


def _args(section: dict, **changes):
    config = config_from_dict({"model": {**section, "dtype": "float32", **changes}})
    config.training.sequence_length = SEQ
    validate(config)
    return config.model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-families")
    return {name: make_hf_dir(name, root) for name in FAMILIES}


def _launch(hf_dirs: dict, runs: dict, out_root: Path) -> dict:
    """One 8-rank launch of ``family_runs`` over ``runs`` (``{run: (family, layout)}``):
    ``{run: result}`` (a last-stage rank's; every rank's losses agree)."""
    sections = {}
    for run, (name, _) in runs.items():
        section = section_of(hf_dirs[name])
        if "moe" in section:  # transformers' loss leaves the auxiliary loss out
            section["moe"]["aux_loss_coef"] = 0.0
        sections[run] = section
    dirs = {run: hf_dirs[name] for run, (name, _) in runs.items()}
    layouts = {run: layout for run, (_, layout) in runs.items()}
    results = run_distributed(family_runs, 8, dirs, sections, layouts, _ids(), str(out_root), timeout=600)
    merged = {}
    for run in runs:
        merged[run] = next(r[run] for r in results if r[run]["logits"] is not None)
        assert all(r[run]["losses"] == merged[run]["losses"] for r in results)
    return merged


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory) -> tuple[dict, Path]:
    """``RUNS`` in one launch, and the root of the checkpoints they saved."""
    out_root = tmp_path_factory.mktemp("hf-families-ckpt")
    return _launch(hf_dirs, RUNS, out_root), out_root


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_logits_equal_transformers_in_float64(name, hf_dirs):
    from nanotrain.hf.import_weights import load_hf_weights
    from nanotrain.models.llama_parallelize import build_llama

    section = section_of(hf_dirs[name])
    assert section["family"] == name
    args = _args(section)
    model = build_llama(args, None)
    load_hf_weights(hf_dirs[name], model, args)
    ids = _ids()[:, :-1]
    with torch.no_grad():
        got = model.eval().double()(ids).transpose(0, 1)
        ref = in_float64(load(hf_dirs[name]))(ids).logits
    scale, worst = ref.abs().max().item(), (got - ref).abs().max().item()
    print(f"{name}: float64 worst |logit difference| {worst:.3g} (largest logit {scale:.3g})")
    assert worst <= 1e-10 * scale


def _reference(path: Path, ids: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """transformers' float32 logits of ``ids[:, :-1]``, mean loss and grad norm."""
    hf = load(path)
    logits = hf(ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None))
    return logits.detach(), loss.item(), norm.item()


def _check_against_transformers(run: str, got: dict, path: Path) -> None:
    logits, loss, norm = _reference(path, _ids())
    scale, worst = logits.abs().max().item(), (got["logits"] - logits).abs().max().item()
    print(
        f"{run}: float32 worst |logit difference| {worst:.3g} (largest {scale:.3g}); loss {got['losses'][0]!r} vs "
        f"{loss!r}; grad norm {got['grad_norms'][0]!r} vs {norm!r}"
    )
    assert worst <= 1e-5 * scale
    assert got["losses"][0] == pytest.approx(loss, rel=1e-5)
    assert got["grad_norms"][0] == pytest.approx(norm, rel=1e-5)
    assert got["losses"][1] == got["losses"][0] and got["grad_norms"][1] == got["grad_norms"][0]  # lr 0


@pytest.mark.parametrize("run", list(RUNS))
def test_parallel_logits_loss_and_grad_norm_equal_transformers(run, runs, hf_dirs):
    _check_against_transformers(run, runs[0][run], hf_dirs[RUNS[run][0]])


# make test-full: the other tp modes, engines and data-parallel mixes, each family.
FULL_DENSE = {
    "tp2pp2cp2-sequence-parallel": dict(tp=2, pp=2, cp=2, tp_mode="REDUCE_SCATTER"),
    "dp2tp2pp2-afab": dict(dp=2, tp=2, pp=2, pp_engine="afab"),
    "dp2cp2tp2-async": dict(dp=2, cp=2, tp=2, tp_mode="REDUCE_SCATTER", tp_linear_async_communication=True),
}
FULL_MOE = {
    "tp2pp2ep2-sequence-parallel": dict(tp=2, pp=2, ep=2, tp_mode="REDUCE_SCATTER"),
    "dp2tp2ep2": dict(dp=2, tp=2, ep=2),
    "cp2pp2ep2": dict(cp=2, pp=2, ep=2),
}
FULL_RUNS = {
    f"{name}@{key}": (name, layout)
    for name in FAMILIES
    for key, layout in (FULL_MOE if name in MOE else FULL_DENSE).items()
}


@pytest.fixture(scope="module")
def full_runs(hf_dirs, tmp_path_factory) -> dict:
    return _launch(hf_dirs, FULL_RUNS, tmp_path_factory.mktemp("hf-families-full"))


@pytest.mark.full
@pytest.mark.parametrize("run", list(FULL_RUNS))
def test_more_layouts_equal_transformers(run, full_runs, hf_dirs):
    _check_against_transformers(run, full_runs[run], hf_dirs[FULL_RUNS[run][0]])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_round_trip_is_bit_identical_and_loads(name, runs, hf_dirs, tmp_path):
    import transformers

    from nanotrain.hf.export import export_hf

    _, ckpt_root = runs
    run = next(r for r, (n, layout) in RUNS.items() if n == name and layout.get("pp") == 2)
    out = tmp_path / "export"
    export_hf(ckpt_root / run, out)
    source, exported = load_file(str(hf_dirs[name] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    if FAMILIES[name][1].get("tie_word_embeddings"):
        source.pop("lm_head.weight", None)  # a tied directory may carry the shared matrix twice
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[k], source[k]) for k in source), [
        k for k in source if not torch.equal(exported[k], source[k])
    ]
    cfg = json.loads((out / "config.json").read_text())
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    cls = type(load(hf_dirs[name])).__name__
    assert cfg["model_type"] == name and cfg["architectures"] == [cls] and type(hf).__name__ == cls
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_directory_of_another_family_is_refused(name, hf_dirs):
    other = "mistral" if name != "mistral" else "qwen2"
    args = _args(section_of(hf_dirs[other]))  # a valid config of another family
    with pytest.raises(HFError) as err:
        check_hf_dir(hf_dirs[name], args)
    message = str(err.value)
    assert "\n" not in message and "model.family" in message, message
    assert f"{name} " in message or f"{name}:" in message or f"'{name}'" in message, message
    assert other in message, message


TRAINED = {"qwen3": dict(dp=2, tp=2, pp=2), "qwen3_moe": dict(tp=2, pp=2, ep=2)}
STEPS = 50


def _windows(module, count: int) -> torch.Tensor:
    """``count`` consecutive windows of SEQ + 1 byte ids of a stdlib module's source (the tiny
    models' vocabulary is the 256 byte values)."""
    data = Path(module.__file__).read_bytes()[: count * (SEQ + 1)]
    assert len(data) == count * (SEQ + 1)
    return torch.tensor(list(data), dtype=torch.long).view(count, SEQ + 1)


def test_trained_at_2x2x2_exports_with_nanotrains_heldout_loss(hf_dirs, tmp_path):
    from nanotrain.hf.export import export_hf

    sections = {name: section_of(hf_dirs[name]) for name in TRAINED}
    batches = _windows(textwrap, STEPS * BATCH).view(STEPS, BATCH, SEQ + 1)
    heldout = _windows(difflib, BATCH)
    results = run_distributed(
        train_and_evaluate, 8, hf_dirs, sections, TRAINED, batches, heldout, str(tmp_path), timeout=600
    )
    for name in TRAINED:
        got = results[0][name]
        assert all(r[name] == got for r in results)
        assert got["losses"][-1] < got["losses"][0] - 1.0, got["losses"]  # it learned
        export_hf(tmp_path / name, tmp_path / f"{name}-hf")
        with torch.no_grad():
            logits = load(tmp_path / f"{name}-hf")(heldout[:, :-1]).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), heldout[:, 1:].reshape(-1))
        rel = abs(got["heldout"] - ref.item()) / ref.item()
        print(
            f"{name} at {TRAINED[name]}: train loss {got['losses'][0]:.3f} -> {got['losses'][-1]:.3f}; held-out: "
            f"nanotrain {got['heldout']!r}, transformers on the export {ref.item()!r} (rel {rel:.2g})"
        )
        assert rel <= 0.01
