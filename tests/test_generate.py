"""``scripts/generate.py``: samples from a nanotrain checkpoint, proven against ``transformers``.

Every family (llama and the six of ``helpers.hf_families``: GQA, q/k/v biases, q/k norms, a
no-RoPE layer, tied and untied embeddings, Mixtral's and Qwen3-MoE's experts), each tiny random
Hugging Face model imported and saved by one process (1,1,1) and, in one 8-rank launch, at
dp2 x tp2 x pp2:

* greedy, 32 new tokens in float64 (where argmax ties cannot flip), from each checkpoint: the
  same tokens with the KV cache and without it, the same from (1,1,1) and (2,2,2), and the same as
  ``transformers``' ``generate(do_sample=False)`` on that checkpoint's export (float64 throughout:
  ``helpers.hf_reference.in_float64``, routers included); the command prints their text;
* sampling: the filtered scores keep the tokens transformers' temperature, top-k and top-p
  warpers keep, with their probabilities; a seed repeats the sample exactly, another seed gives
  another;
* a bad argument is one ``error:`` line, exit 2 (the ones told before torch also in
  test_scripts_promise, with torch poisoned).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nanotrain.checkpoint.offline_checks import plan_generate
from nanotrain.checkpoint.plain_model import load_plain_model
from nanotrain.data.tokenizer import ByteTokenizer
from nanotrain.models.generate import Sampling, generate, sampling_scores
from nanotrain.models.llama import CausalCore

from helpers.dist import run_distributed
from helpers.generate_ranks import save_imported
from helpers.hf_families import FAMILIES, load, make_hf_dir
from helpers.hf_reference import in_float64
from helpers.runs import ROOT

NAMES = ("llama", *FAMILIES)
PROMPT = "def fibonacci(n):"
NEW = 32
LAYOUTS = {"1-1-1": dict(dp=1, tp=1, pp=1), "2-2-2": dict(dp=2, tp=2, pp=2)}
# Saved in the same launch, for some families: expert and context parallel shards.
MORE = {
    "tp2-pp2-ep2": (dict(tp=2, pp=2, ep=2), ("qwen3_moe",)),
    "cp2-tp2-pp2": (dict(cp=2, tp=2, pp=2), ("smollm3",)),
}


def _script():
    spec = importlib.util.spec_from_file_location("_script_generate", ROOT / "scripts" / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


script = _script()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{layout: checkpoints root}``: every family's HF directory imported and saved at each of
    ``LAYOUTS`` (and ``MORE``'s families at its layouts) as ``root/<family>/step_000001``; all but
    the 1-1-1 ones in one 8-rank launch."""
    base = tmp_path_factory.mktemp("generate")
    hf_dirs = {name: make_hf_dir(name, base / "hf") for name in NAMES}
    save_imported([(hf_dirs[n], LAYOUTS["1-1-1"], str(base / "1-1-1" / n)) for n in NAMES], ranks=False)
    jobs = [(hf_dirs[n], LAYOUTS["2-2-2"], str(base / "2-2-2" / n)) for n in NAMES]
    jobs += [(hf_dirs[n], layout, str(base / key / n)) for key, (layout, names) in MORE.items() for n in names]
    run_distributed(save_imported, 8, jobs, timeout=300)
    return {key: base / key for key in [*LAYOUTS, *MORE]}


def _transformers_greedy(export_dir, prompt: list[int], eos: bool) -> list[int]:
    """transformers' greedy tokens after ``prompt`` on the export, in float64; ``eos`` False: past
    the eos of the export's generation_config.json too (all NEW tokens)."""
    hf = in_float64(load(export_dir))
    if not eos:
        hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers_with_and_without_cache_at_every_layout(name, runs, tmp_path, capsys):
    from nanotrain.hf.export import export_hf

    prompt = list(PROMPT.encode())
    got = {}
    for layout in LAYOUTS:
        root = runs[layout]
        ckpt, meta = plan_generate(root / name)
        model = load_plain_model(ckpt, meta, torch.float64)
        cached = generate(model, prompt, NEW)  # no stop token: all NEW tokens compared
        assert all(type(layer.attn.core) is CausalCore for layer in model.layers.values())  # put back
        assert generate(model, prompt, NEW, cache=False) == cached
        export_hf(root / name, tmp_path / layout)
        reference = _transformers_greedy(tmp_path / layout, prompt, eos=False)
        assert cached == reference and len(cached) == NEW, (layout, cached, reference)
        got[layout] = cached
    assert got["1-1-1"] == got["2-2-2"]
    # The command stops where transformers stops with the export's generation config (eos = id 0,
    # the byte tokenizer's separator) and prints the text before it.
    stopped = _transformers_greedy(tmp_path / "2-2-2", prompt, eos=True)
    assert stopped == got["2-2-2"][: len(stopped)] and (stopped[-1] == 0 or len(stopped) == NEW)
    argv = [str(runs["2-2-2"] / name), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--dtype", "float64"]
    assert script.main([*argv, "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out == script.shown(ByteTokenizer().decode([t for t in stopped if t != 0])) + "\n"
    assert "saved at dp2 tp2 pp2" in err and f"{len(stopped)} new tokens, greedy" in err, err
    print(f"{name}: {NEW} greedy tokens equal transformers' from 1-1-1 and 2-2-2; eos after {len(stopped)}")


@pytest.mark.parametrize("layout, name", [(key, n) for key, (_, names) in MORE.items() for n in names])
def test_expert_and_context_parallel_checkpoints_decode_alike(layout, name, runs):
    prompt = list(PROMPT.encode())
    tokens = []
    for key in ("1-1-1", layout):
        ckpt, meta = plan_generate(runs[key] / name)
        tokens.append(generate(load_plain_model(ckpt, meta, torch.float64), prompt, NEW))
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("name", ["smollm3", "qwen3_moe"])
def test_the_cache_fed_in_chunks_gives_the_whole_sequences_logits(name, runs):
    """Several new tokens at once after the cache holds some (the causal mask offset by the cached
    length), on a model with a no-RoPE layer and on one with q/k norms and experts."""
    from nanotrain.models.kv_cache import KVCache

    ckpt, meta = plan_generate(runs["1-1-1"] / name)
    model = load_plain_model(ckpt, meta, torch.float64)
    ids = torch.tensor([list(PROMPT.encode()) * 2])
    with torch.no_grad():
        whole = model(ids)
        with KVCache(model, ids.shape[1]) as cache:
            parts = [cache.forward(chunk) for chunk in ids.split([5, 1, 12, 16], dim=1)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-12)


def test_logits_that_are_not_finite_are_refused(runs):
    ckpt, meta = plan_generate(runs["1-1-1"] / "llama")
    model = load_plain_model(ckpt, meta)
    with torch.no_grad():
        model.final_norm.weight[0] = float("nan")
    for sampling in (Sampling(), Sampling(1.0)):
        with pytest.raises(FloatingPointError, match="not finite"):
            generate(model, list(PROMPT.encode()), 4, sampling)


def test_sampling_filters_are_transformers_warpers():
    from transformers.generation import logits_process as lp

    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (0.9, 50, 0.5), (2.0, 1, 0.3)]:
        sampling = Sampling(temperature, top_k, top_p)
        warpers = [lp.TemperatureLogitsWarper(temperature)]
        warpers += [lp.TopKLogitsWarper(top_k)] if top_k else []
        warpers += [lp.TopPLogitsWarper(top_p)] if top_p < 1 else []
        expected = logits.clone()
        for warp in warpers:
            expected = warp(None, expected)
        got = torch.stack([sampling_scores(row, sampling) for row in logits])
        assert torch.equal(got.isfinite(), expected.isfinite()), (temperature, top_k, top_p)  # the same tokens kept
        torch.testing.assert_close(got.softmax(-1), expected.softmax(-1), rtol=1e-12, atol=0)
    tiny = sampling_scores(logits[0], Sampling(1e-308))  # the largest logit alone, not a nan
    assert tiny.softmax(-1).argmax() == logits[0].argmax() and tiny.softmax(-1).max() == 1


def test_a_seed_repeats_the_sample_exactly_and_another_differs(runs, capsys):
    run = str(runs["2-2-2"] / "qwen3_moe")

    def sample(*flags: str):
        assert script.main([run, "--prompt", PROMPT, "--max-new-tokens", "24", "--temperature", "1.5", *flags]) == 0
        return capsys.readouterr()

    first = sample("--seed", "1")
    assert "sampled, seed 1," in first.err, first.err
    assert sample("--seed", "1").out == first.out
    assert sample("--seed", "2").out != first.out
    narrow = sample("--seed", "1", "--top-k", "8", "--top-p", "0.8")
    assert sample("--seed", "1", "--top-k", "8", "--top-p", "0.8").out == narrow.out
    unseeded = sample()  # a random seed, printed so that the sample can be repeated
    seed = unseeded.err.split("sampled, seed ")[1].split(",")[0]
    assert sample("--seed", seed).out == unseeded.out


def test_step_and_the_context_limit(runs, capsys):
    run = str(runs["1-1-1"] / "mistral")
    assert script.main([run, "--step", "1", "--prompt", "x", "--max-new-tokens", "500"]) == 0
    err = capsys.readouterr().err
    # 128 positions: a 1-token prompt gets 128 new tokens (the last one is never fed), unless eos comes first
    limited = "stopped at model.max_position_embeddings" in err and "1 prompt + 128 new tokens" in err
    assert limited or "stopped at eos" in err, err


def test_a_sample_is_printed_safe_for_a_terminal_unless_raw(runs, capsys):
    assert script.shown("a\tb\nc\x1b[2J\u202e\u200b\x85d\ufffd") == "a\tb\nc\\x1b[2J\\u202e\\u200b\\x85d\ufffd"
    run = str(runs["1-1-1"] / "qwen2")
    texts = {}
    for raw in ([], ["--raw"]):
        assert script.main([run, "--prompt", PROMPT, "--max-new-tokens", "40", *raw]) == 0
        texts[bool(raw)] = capsys.readouterr().out
    assert texts[False] == script.shown(texts[True][:-1]) + "\n"


@pytest.mark.parametrize("style", ["byte", "llama3", "mistral", "qwen2"])
def test_decoding_stops_at_the_eos_the_export_names(style, tmp_path):
    """The stop token is the export's eos: the separator, or the eos of a tokenizer_config.json
    beside the run's tokenizer.json (an instruct model's end of turn), with and without one."""
    from nanotrain.data.hf_tokenizer import export_tokenizer, special_token_ids

    from helpers.family_tokenizers import write_family_dir

    specs = ["byte"]
    if style != "byte":
        specs = [str(write_family_dir(style, tmp_path / f"{style}-{c}", config=c)) for c in (True, False)]
    for i, spec in enumerate(specs):
        (tmp_path / f"out-{i}").mkdir()
        assert special_token_ids(spec) == export_tokenizer(spec, tmp_path / f"out-{i}", 128)


BAD = [  # (arguments after RUN_DIR, what the one line says)
    (["--prompt", "x", "--step", "7"], "--step 7: no complete checkpoint of that step in"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    (["--prompt", "x", "--max-new-tokens", "two"], "argument --max-new-tokens: invalid int value"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be a number >= 0"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature nan"),
    (["--prompt", "x", "--temperature", "1", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--prompt", "x", "--temperature", "1", "--top-k", "-1"], "--top-k -1: must be >= 0"),
    (["--prompt", "x", "--top-k", "5", "--seed", "1"], "--top-k, --seed: only for sampling"),
    (["--prompt", "x", "--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["--prompt", "x", "--step", "-2"], "argument --step: -2 must be >= 0"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "x" * 129], "--prompt: 129 tokens, longer than model.max_position_embeddings (128)"),
    ([], "the following arguments are required: --prompt"),
    (["--prompt", "x", "--device", "tpu"], "--device 'tpu': give auto, cpu, cuda or cuda:N"),
    (["--prompt", "x", "--device", "cuda:99"], "--device cuda:99: no such CUDA device here"),
    (["--prompt", "x", "--dtype", "int8"], "argument --dtype: invalid choice"),
]


@pytest.mark.parametrize("args, says", BAD, ids=[" ".join(a)[:40] for a, _ in BAD])
def test_a_bad_argument_is_one_line(args, says, runs, capsys):
    code = script.main([str(runs["1-1-1"] / "llama"), *args])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert says in lines[0], lines[0]
    assert out == ""


def test_a_run_without_a_checkpoint_is_one_line(tmp_path, capsys):
    cases = ((tmp_path / "missing", "no such run or checkpoint directory"), (tmp_path, "no complete checkpoint"))
    for run, says in cases:
        assert script.main([str(run), "--prompt", "x"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
