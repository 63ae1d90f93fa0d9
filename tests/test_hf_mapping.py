"""The Hugging Face families beside Llama: Mistral, Qwen2, Qwen3, SmolLM3, Mixtral, Qwen3-MoE.

For each, a tiny random transformers model with every option on (GQA; Mistral a sliding window;
Qwen2 q/k/v biases; Qwen3 head_dim != hidden / heads and q/k norms; SmolLM3 one NoPE layer;
Mixtral 4 experts top 2; Qwen3-MoE a dense and a sparse layer, renormalised top-k) is saved with
``save_pretrained`` and proven against the mapping:

* ``scripts/hf_config.py``'s section parses and validates;
* ``hf_shapes`` is the safetensors header, names and shapes, nothing missing or extra;
* HF -> nanotrain tensors (``load_hf_state_dict``: the import's own per-slice reads) -> a
  nanotrain checkpoint -> ``export_hf`` is bit-identical to the saved file, tensor by tensor, and
  ``AutoModelForCausalLM`` loads the export as the same class with no missing or unexpected key,
  the same config values and the same logits as the original (so windows, NoPE layers and
  routing survive the config.json round trip);
* ``nanotrain_shapes`` is ``LlamaModel``'s parameters, every family's options included; an
  imported Mixtral at pp2·ep2 has transformers' first-step loss; an ep rank reads only its
  experts; another family, an unknown model_type and each config value nanotrain cannot compute
  are refused in one line.

The numerics of the other options are the model's (tests of its own); this file needs none of them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: the reference
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from nanotrain.config import Config, ModelArgs, MoEArgs, TrainingArgs, config_from_dict, validate
from nanotrain.hf.directory import HFError, check_hf_dir
from nanotrain.models.family import FAMILIES, family_of
from nanotrain.models.hf_mapping import nanotrain_shapes

from helpers.dist import run_distributed
from helpers.hf_ranks import first_step_losses

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=32, head_dim=16),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "smollm3": lambda: transformers.SmolLM3Config(**COMMON, no_rope_layers=[1, 0]),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        decoder_sparse_step=2,
        norm_topk_prob=True,
    ),
}
NEW = list(CONFIGS)
# HF config attributes an export must give back as they were
SAME = (
    "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "rms_norm_eps tie_word_embeddings rope_parameters sliding_window use_sliding_window layer_types "
    "no_rope_layers num_local_experts num_experts_per_tok moe_intermediate_size norm_topk_prob "
    "decoder_sparse_step mlp_only_layers router_aux_loss_coef"
).split()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """family -> a saved tiny random model; every weight random (norms and biases too)."""
    root, out = tmp_path_factory.mktemp("hf_families"), {}
    for name, make in CONFIGS.items():
        torch.manual_seed(len(out))
        model = transformers.AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _hf_config_script():
    spec = importlib.util.spec_from_file_location("_script_hf_config", ROOT / "scripts" / "hf_config.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _section(path: Path, capsys) -> dict:
    """The ``model:`` section ``scripts/hf_config.py PATH`` prints, parsed as a user's YAML is."""
    assert _hf_config_script().main([str(path)]) == 0
    return yaml.safe_load(capsys.readouterr().out)["model"]


def _args(section: dict) -> ModelArgs:
    config = config_from_dict({"model": {**section, "dtype": "float32"}})
    config.training = TrainingArgs(sequence_length=SEQ)
    validate(config)
    return config.model


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("name", NEW)
def test_section_validates_and_hf_shapes_are_the_header(name, hf_dirs, capsys):
    section = _section(hf_dirs[name], capsys)
    assert section["family"] == name
    args = _args(section)
    mapping = FAMILIES[name].hf
    cfg = json.loads((hf_dirs[name] / "config.json").read_text())
    assert mapping.unsupported(cfg) == [] and mapping.mismatches(args, cfg) == [] and mapping.inexpressible(args) == []
    header = _header(hf_dirs[name])
    if args.tie_word_embeddings:
        header.pop("lm_head.weight", None)
    assert mapping.hf_shapes(args) == header
    want = {
        "mistral": dict(sliding_window=32, head_dim=16),
        "qwen2": dict(qkv_bias=True),
        "qwen3": dict(qk_norm=True, head_dim=16),
        "smollm3": dict(no_rope_layers=[1], tie_word_embeddings=True),
        "qwen3_moe": dict(qk_norm=True, head_dim=16),
    }.get(name, {})
    assert {k: getattr(args, k) for k in want} == want
    if args.moe is not None:
        moe = args.moe
        assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (4, 2, True)
        assert (moe.first_dense_layers, moe.layer_frequency) == ((0, 1) if name == "mixtral" else (1, 2))


@pytest.mark.parametrize("name", ["llama", *NEW])
def test_nanotrain_names_are_the_models(name, hf_dirs, capsys):
    """``nanotrain_shapes`` is ``LlamaModel``'s parameters, names and shapes, every family's
    options included."""
    from nanotrain.models.llama import LlamaModel

    section = {**_section(hf_dirs[name], capsys), "family": name} if name != "llama" else {}
    args = _args(section) if section else ModelArgs(tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaModel(args)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == nanotrain_shapes(args)


def _holder(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are ``tensors`` under their nanotrain names (a checkpoint's model)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t.clone()))
    return root


def _value(config, key: str):
    """A config attribute as the model uses it (``head_dim: null`` is hidden / heads)."""
    value = getattr(config, key)
    return value if key != "head_dim" or value else config.hidden_size // config.num_attention_heads


@pytest.mark.parametrize("name", NEW)
def test_hf_to_nanotrain_to_export_is_bit_identical(name, hf_dirs, tmp_path, capsys):
    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.hf.export import export_hf
    from nanotrain.hf.import_weights import load_hf_state_dict

    src = hf_dirs[name]
    args = _args(_section(src, capsys))
    mapping = family_of(args).hf
    hf = load_file(str(src / "model.safetensors"))
    mine = load_hf_state_dict(src, args)
    assert {n: tuple(t.shape) for n, t in mine.items()} == nanotrain_shapes(args)
    for n, full in mine.items():  # every piece is its HF tensor, and the pieces tile the tensor
        pieces = mapping.pieces(n, args)
        for p in pieces:
            rows = full if p.lead is None else full[p.lead]
            assert torch.equal(rows[p.start : p.stop], hf[p.hf_name]), (n, p)
        rows = full.shape[0] * (full.shape[1] if pieces[0].lead is not None else 1)
        assert sum(p.stop - p.start for p in pieces) == rows, n
    layer = "layers.1." if args.moe else "layers.0."
    if args.moe:  # the layout facts, stated without the pieces
        e3 = mine[layer + "mlp.experts.gate_up.weight"][3]
        gate, up, down = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        prefix = "model.layers.1." + ("block_sparse_moe.experts.3." if name == "mixtral" else "mlp.experts.3.")
        assert torch.equal(e3, torch.cat([hf[f"{prefix}{gate}.weight"], hf[f"{prefix}{up}.weight"]]))
        assert torch.equal(mine[layer + "mlp.experts.down.weight"][3], hf[f"{prefix}{down}.weight"])
    if args.qkv_bias:
        b = [hf[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"]
        assert torch.equal(mine["layers.0.attn.qkv.bias"], torch.cat(b))

    ckpt = save_checkpoint(tmp_path / "ckpt", 1, _holder(mine), config=Config(model=args))
    export_hf(ckpt, tmp_path / "out")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = {k: v for k, v in hf.items() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    assert set(out) == set(expected)
    assert all(torch.equal(out[k], expected[k]) for k in expected)

    original = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32, output_loading_info=True
    )
    assert type(loaded).__name__ == mapping.ARCHITECTURE == type(original).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for key in SAME:
        if hasattr(original.config, key):
            assert _value(loaded.config, key) == _value(original.config, key), key
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))  # beyond the window
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, original(ids).logits)


def test_mixtral_first_step_loss_at_pp2_ep2_equals_transformers(hf_dirs, capsys):
    """Mixtral needs none of the model's new options: imported at a topology that cuts the experts
    (each ep rank reads its experts' tensors), it is transformers' function, not only its tensors."""
    section = _section(hf_dirs["mixtral"], capsys)
    section["moe"] = MoEArgs(**section["moe"])
    ids = torch.randint(0, 96, (4, SEQ + 1), generator=torch.Generator().manual_seed(3))
    layout = dict(pp=2, ep=2)
    losses = run_distributed(first_step_losses, 4, hf_dirs, [layout], None, {"mixtral": section}, ids, timeout=300)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs["mixtral"]), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(ids[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), ids[:, 1:].reshape(-1)).item()
    assert losses[0][(str(layout), "mixtral")] == pytest.approx(want, rel=1e-5)


def test_an_ep_rank_reads_only_its_experts(hf_dirs, capsys):
    from nanotrain.hf.import_weights import _fill, load_hf_state_dict
    from nanotrain.parallel.sharding import row_shard_info, set_shard_info

    args = _args(_section(hf_dirs["mixtral"], capsys))
    full = load_hf_state_dict(hf_dirs["mixtral"], args)
    hf = check_hf_dir(hf_dirs["mixtral"], args)
    for field, per_expert in (("mlp.experts.gate_up.weight", 2), ("mlp.experts.down.weight", 1)):
        name = "layers.1." + field
        shape = tuple(full[name].shape)
        local = torch.zeros(2, *shape[1:])
        set_shard_info(local, row_shard_info(shape, 0, (shape[0],), 1, 2, axis="ep"))  # experts 2, 3
        reads, _ = _fill(local, name, args, hf, {})
        assert reads == 2 * per_expert and torch.equal(local, full[name][2:])
    # a tp rank's rows of the fused q/k/v bias: its q, k and v rows (1-D pieces)
    args = _args(_section(hf_dirs["qwen2"], capsys))
    full = load_hf_state_dict(hf_dirs["qwen2"], args)["layers.0.attn.qkv.bias"]
    bias = torch.zeros(full.shape[0] // 2)
    set_shard_info(bias, row_shard_info(tuple(full.shape), 0, (32, 16, 16), 1, 2))
    _fill(bias, "layers.0.attn.qkv.bias", args, check_hf_dir(hf_dirs["qwen2"], args), {})
    assert torch.equal(bias, torch.cat([full[16:32], full[40:48], full[56:64]]))


def test_fused_expert_stacks_are_read_too(hf_dirs, tmp_path, capsys):
    """transformers 5.x writes (``save_original_format=False``) and reads fused expert stacks."""
    from nanotrain.hf.import_weights import load_hf_state_dict

    for name in ("mixtral", "qwen3_moe"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dirs[name]), dtype=torch.float32)
        model.save_pretrained(tmp_path / name, save_original_format=False)
        assert "model.layers.1.mlp.experts.gate_up_proj" in _header(tmp_path / name)
        args = _args(_section(hf_dirs[name], capsys))
        assert check_hf_dir(tmp_path / name, args).fused
        fused, plain = load_hf_state_dict(tmp_path / name, args), load_hf_state_dict(hf_dirs[name], args)
        assert all(torch.equal(fused[k], plain[k]) for k in plain)


def test_other_family_and_unknown_model_type_are_refused(hf_dirs, tmp_path, capsys):
    args = _args(_section(hf_dirs["qwen3"], capsys))
    with pytest.raises(HFError) as err:
        check_hf_dir(hf_dirs["qwen3"], replace(args, family="llama"))
    msg = str(err.value)
    assert "\n" not in msg
    assert "holds a qwen3 model (Qwen3ForCausalLM) but model.family is llama: set model.family: qwen3" in msg
    assert "scripts/hf_config.py" in msg
    odd = tmp_path / "gpt2"
    shutil.copytree(hf_dirs["qwen2"], odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(HFError, match="model_type 'gpt2'.*nanotrain imports llama"):
        check_hf_dir(odd, args)
    assert _hf_config_script().main([str(odd)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_type 'gpt2'" in err and "smollm3 (SmolLM3ForCausalLM)" in err, err
    # a model section's mismatches are one line each, naming both values
    cfg = json.loads((hf_dirs["qwen3"] / "config.json").read_text())
    problems = FAMILIES["qwen3"].hf.mismatches(replace(args, qk_norm=False, head_dim=None), cfg)
    assert len(problems) == 2 and all("\n" not in p for p in problems), problems
    assert "model.qk_norm is False but config.json has qk_norm True" in problems[0]
    assert "8 features per head" in problems[1] and "set model.head_dim: 16" in problems[1]


def _cfg(hf_dirs, name, **changes) -> dict:
    """The saved config.json with ``changes``; without its ``layer_types`` (5.x writes them out,
    and they win over ``max_window_layers`` and the NoPE layers)."""
    cfg = json.loads((hf_dirs[name] / "config.json").read_text())
    cfg.pop("layer_types", None)
    return {**cfg, **changes}


REFUSED = [
    ("qwen3", dict(attention_bias=True), "no bias on o_proj"),
    ("qwen3_moe", dict(attention_bias=True), "no bias on o_proj"),
    ("smollm3", dict(mlp_bias=True), "mlp_bias: true"),
    ("smollm3", dict(no_rope_layers=[1, 2]), "0/1 entry"),
    ("smollm3", dict(no_rope_layers=[1]), "each of the 2 layers"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok 5"),
    ("qwen3_moe", dict(decoder_sparse_step=1, mlp_only_layers=[0, 1]), "no layer has experts"),
    ("qwen3_moe", dict(num_experts=8), "num_experts 8 but num_local_experts 4"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "on layers [1] only"),
    ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope scaling 'yarn'"),
    ("mistral", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ("mistral", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("qwen3", dict(architectures=["Qwen2ForCausalLM"]), "only 'qwen3' / Qwen3ForCausalLM"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in REFUSED])
def test_config_values_nanotrain_cannot_compute_are_one_line(case, hf_dirs):
    name, changes, fragment = case
    problems = FAMILIES[name].hf.unsupported(_cfg(hf_dirs, name, **changes))
    assert len(problems) == 1 and "\n" not in problems[0] and fragment in problems[0], problems


def test_windows_and_layer_patterns_read_as_transformers_builds_them(hf_dirs):
    qwen2 = FAMILIES["qwen2"].hf
    on = dict(use_sliding_window=True, sliding_window=16)
    assert qwen2.model_section(_cfg(hf_dirs, "qwen2", **on, max_window_layers=0))["sliding_window"] == 16
    assert "sliding_window" not in qwen2.model_section(_cfg(hf_dirs, "qwen2", sliding_window=16))  # switched off
    covering = _cfg(hf_dirs, "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert qwen2.unsupported(covering) == [] and "sliding_window" not in qwen2.model_section(covering)
    qwen3 = _cfg(hf_dirs, "qwen3")
    del qwen3["head_dim"]  # Qwen3Config's default is 128, not hidden / heads
    assert FAMILIES["qwen3"].hf.model_section(qwen3)["head_dim"] == 128
    moe = FAMILIES["qwen3_moe"].hf
    section = moe.model_section(_cfg(hf_dirs, "qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[0]))
    assert (section["moe"]["first_dense_layers"], section["moe"]["layer_frequency"]) == (1, 1)
    assert (
        "cannot give"
        in moe.unsupported(_cfg(hf_dirs, "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[1]))[
            0
        ]
    )
    # export writes every nanotrain pattern so that transformers' rule gives back its MoE layers
    base = _args(moe.model_section(_cfg(hf_dirs, "qwen3_moe")))
    for layers in range(1, 6):
        for first in range(layers):
            for every in range(1, layers + 1):
                args = replace(
                    base, num_layers=layers, moe=replace(base.moe, first_dense_layers=first, layer_frequency=every)
                )
                cfg = moe.hf_config(args, dtype="float32", bos_token_id=None, eos_token_id=None)
                step, dense = cfg["decoder_sparse_step"], cfg["mlp_only_layers"]
                sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
                assert sparse == list(range(first, layers, every)), (layers, first, every)
                assert moe.mismatches(args, cfg) == []


def test_what_a_family_cannot_describe_is_refused_before_export(tmp_path):
    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.checkpoint.layout import CheckpointError
    from nanotrain.checkpoint.offline_checks import plan_export

    assert family_of(config_from_dict({"model": {}}).model).name == "llama"  # saved before model.family
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_attention_heads=2)
    for family, changes, fragment in [
        ("llama", dict(moe=MoEArgs(num_experts=2, top_k=1)), "LlamaForCausalLM has no experts"),
        ("qwen2", {}, "Qwen2ForCausalLM always has q/k/v biases"),
        ("mixtral", dict(moe=MoEArgs(num_experts=2, top_k=1, layer_frequency=2)), "every layer of MixtralForCausalLM"),
        ("mistral", dict(qk_norm=True), "MistralForCausalLM has no q/k norms"),
    ]:
        args = ModelArgs(**small, family=family, **changes)
        ckpt = save_checkpoint(tmp_path / family, 1, _holder({"w": torch.zeros(1)}), config=Config(model=args))
        with pytest.raises(CheckpointError) as err:
            plan_export(ckpt, tmp_path / f"{family}-out", "float32")
        assert "\n" not in str(err.value) and fragment in str(err.value), str(err.value)
        assert not (tmp_path / f"{family}-out").exists()
