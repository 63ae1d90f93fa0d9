"""Every bad input a user can give: exit status 2, one `error:` line naming the field and the fix,
no traceback, and nothing submitted or started (these run with no SLURM needed: --dry-run and
validation happen before any submission)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers.cli import run_cli
from helpers.runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    mutate(raw)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# (id, config mutation or None, extra CLI args, fragments the one-line message must contain)
BAD_CONFIGS = [
    ("unknown-key", lambda c: c["parallelism"].update(tpp=2), [], ["parallelism.tpp", "did you mean 'tp'"]),
    ("unknown-section", lambda c: c.update(paralelism={"dp": 1}), [], ["paralelism", "did you mean 'parallelism'"]),
    ("wrong-type-int", lambda c: c["parallelism"].update(dp="two"), [], ["parallelism.dp", "expected an integer"]),
    (
        "wrong-type-bool",
        lambda c: c["model"].update(tie_word_embeddings="yes please"),
        [],
        ["model.tie_word_embeddings", "true or false"],
    ),
    ("float-for-int", lambda c: c["training"].update(train_steps=1.5), [], ["training.train_steps", "integer"]),
    ("out-of-range", lambda c: c["parallelism"].update(tp=0), [], ["parallelism.tp", "minimum 1"]),
    ("negative-lr", lambda c: c["optimizer"].update(lr=-1.0), [], ["optimizer.lr", "minimum"]),
    (
        "bad-choice",
        lambda c: c["parallelism"].update(pp_engine="gpipe"),
        [],
        ["parallelism.pp_engine", "'afab'", "'1f1b'"],
    ),
    ("bad-tp-mode", lambda c: c["parallelism"].update(tp_mode="SEQUENCE"), [], ["parallelism.tp_mode"]),
    ("bad-dtype", lambda c: c["model"].update(dtype="fp8"), [], ["model.dtype", "bfloat16"]),
    (
        "bad-recompute",
        lambda c: c["training"].update(recompute="partial"),
        [],
        ["training.recompute", "none", "selective", "full"],
    ),
    ("compile-not-bool", lambda c: c["training"].update(compile="yes"), [], ["training.compile"]),
    # training.spike (issue 31 item 2)
    (
        "spike-bad-policy",
        None,
        ["--set", "training.spike.policy=retry"],
        ["training.spike.policy", "'stop', 'skip', 'rewind'"],
    ),
    ("spike-factor-one", None, ["--set", "training.spike.factor=1"], ["training.spike.factor", "above 1.0"]),
    ("spike-window-zero", None, ["--set", "training.spike.window=0"], ["training.spike.window", "minimum 1"]),
    ("spike-window-huge", None, ["--set", "training.spike.window=5000"], ["training.spike.window", "maximum"]),
    (
        "spike-rewind-without-checkpoints",
        None,
        ["--set", "training.spike.policy=rewind", "--set", "checkpoints.interval=0"],
        ["training.spike.policy: rewind", "checkpoints.interval is 0", "policy skip"],
    ),
    ("spike-rewinds-negative", None, ["--set", "training.spike.max_rewinds=-1"], ["training.spike.max_rewinds"]),
    (
        "spike-skips-in-a-row-zero",
        None,
        ["--set", "training.spike.max_consecutive_skips=0"],
        ["training.spike.max_consecutive_skips", "minimum 1"],
    ),
    ("spike-unknown-key", None, ["--set", "training.spike.k=3"], ["training.spike.k", "unknown key"]),
    # slurm.health, slurm.max_excluded_nodes (issue 31 items 1, 4)
    (
        "health-enabled-not-bool",
        None,
        ["--set", "slurm.health.enabled=maybe"],
        ["slurm.health.enabled", "true or false"],
    ),
    (
        "health-matmul-one",
        None,
        ["--set", "slurm.health.matmul_slowdown=1"],
        ["slurm.health.matmul_slowdown", "above 1.0"],
    ),
    (
        "health-allreduce-huge",
        None,
        ["--set", "slurm.health.allreduce_slowdown=5000"],
        ["slurm.health.allreduce_slowdown", "maximum"],
    ),
    (
        "health-straggler-slowdown-below-one",
        None,
        ["--set", "slurm.health.straggler_slowdown=0.5"],
        ["slurm.health.straggler_slowdown", "above 1.0"],
    ),
    (
        "health-straggler-intervals-zero",
        None,
        ["--set", "slurm.health.straggler_intervals=0"],
        ["slurm.health.straggler_intervals", "minimum 1"],
    ),
    ("health-not-a-mapping", lambda c: c["slurm"].update(health=3), [], ["slurm.health", "mapping"]),
    ("health-unknown-key", None, ["--set", "slurm.health.treshold=2"], ["slurm.health.treshold", "unknown key"]),
    (
        "excluded-nodes-negative",
        None,
        ["--set", "slurm.max_excluded_nodes=-1"],
        ["slurm.max_excluded_nodes", "minimum 0", "0 never excludes a node"],
    ),
    ("excluded-nodes-float", None, ["--set", "slurm.max_excluded_nodes=1.5"], ["slurm.max_excluded_nodes", "integer"]),
    (
        "loss-chunk-negative",
        lambda c: c["training"].update(loss_chunk_tokens=-1),
        [],
        ["training.loss_chunk_tokens", "minimum 0", "0 turns the chunked loss off"],
    ),
    (
        "float16-no-scaler",
        lambda c: c["model"].update(dtype="float16"),
        [],
        ["model.dtype", "loss scaling", "bfloat16"],
    ),
    (
        "timeout-zero",
        lambda c: c["training"].update(collective_timeout_s=0),
        [],
        ["training.collective_timeout_s", "minimum"],
    ),
    ("betas-shape", lambda c: c["optimizer"].update(betas=[0.9]), [], ["optimizer.betas", "2 values"]),
    ("betas-range", lambda c: c["optimizer"].update(betas=[0.9, 1.5]), [], ["optimizer.betas[1]", "[0, 1)"]),
    ("section-not-mapping", lambda c: c.update(training=[1, 2]), [], ["training", "mapping"]),
    (
        "heads-vs-tp",
        lambda c: c["parallelism"].update(tp=8, dp=1, pp=1),
        [],
        ["model.num_attention_heads", "parallelism.tp"],
    ),
    (
        "kv-heads-vs-tp",
        lambda c: c["model"].update(num_key_value_heads=1),
        [],
        ["model.num_key_value_heads", "parallelism.tp"],
    ),
    (
        "heads-vs-kv",
        lambda c: c["model"].update(num_attention_heads=4, num_key_value_heads=3),
        [],
        ["model.num_attention_heads", "num_key_value_heads"],
    ),
    (
        "seq-vs-cp",
        lambda c: (c["parallelism"].update(cp=2, dp=1), c["training"].update(sequence_length=66)),
        [],
        ["training.sequence_length (66)", "2*parallelism.cp = 4"],
    ),
    (
        "cp-balance-unmasked",
        lambda c: c["parallelism"].update(cp=2, dp=1, cp_balance="documents"),
        [],
        ["parallelism.cp_balance 'documents'", "data.document_masking: true"],
    ),
    (
        "flex-kernel-without-document-masking",
        lambda c: c["model"].update(attention_kernel="flex"),
        [],
        ["model.attention_kernel 'flex'", "data.document_masking: true"],
    ),
    (
        "seq-vs-cp-tp-rs",
        lambda c: (
            c["parallelism"].update(cp=2, dp=1, tp=4, tp_mode="REDUCE_SCATTER"),
            c["model"].update(num_key_value_heads=4),
            c["training"].update(sequence_length=12),
        ),
        [],
        ["training.sequence_length/parallelism.cp = 12/2", "parallelism.tp (4)", "REDUCE_SCATTER"],
    ),
    (
        "ep-dense-model",
        lambda c: c["parallelism"].update(ep=2, dp=1),
        [],
        ["parallelism.ep (2)", "set parallelism.ep: 1"],
    ),
    (
        "moe-top-k",
        lambda c: c["model"].update(moe={"num_experts": 4, "top_k": 5}),
        [],
        ["model.moe.top_k (5)", "num_experts (4)"],
    ),
    (
        "moe-experts-vs-ep",
        lambda c: (c["parallelism"].update(ep=2, dp=1), c["model"].update(moe={"num_experts": 3, "top_k": 1})),
        [],
        ["model.moe.num_experts (3)", "parallelism.ep (2)"],
    ),
    (
        "moe-capacity-zero",
        lambda c: c["model"].update(moe={"capacity_factor": 0}),
        [],
        ["model.moe.capacity_factor", "must be above 0"],
    ),
    (
        "moe-unknown-key",
        lambda c: c["model"].update(moe={"experts": 4}),
        [],
        ["model.moe.experts", "did you mean 'num_experts'"],
    ),
    (
        "moe-no-moe-layer",
        lambda c: c["model"].update(moe={"first_dense_layers": 4}),
        [],
        ["model.moe.first_dense_layers (4)", "no MoE layer"],
    ),
    (
        "moe-init-from-hf",
        lambda c: (c["checkpoints"].update(init_from_hf="/tmp"), c["model"].update(moe={})),
        [],
        ["checkpoints.init_from_hf", "model.moe"],
    ),
    ("hidden-vs-heads", lambda c: c["model"].update(hidden_size=66), [], ["model.hidden_size", "num_attention_heads"]),
    (
        "intermediate-vs-tp",
        lambda c: c["model"].update(intermediate_size=255),
        [],
        ["model.intermediate_size", "parallelism.tp"],
    ),
    (
        "seq-vs-tp-rs",
        lambda c: (c["parallelism"].update(tp_mode="REDUCE_SCATTER"), c["training"].update(sequence_length=63)),
        [],
        ["training.sequence_length", "REDUCE_SCATTER"],
    ),
    ("layers-vs-pp", lambda c: c["model"].update(num_layers=1), [], ["model.num_layers", "parallelism.pp"]),
    (
        "layers-vs-virtual",
        lambda c: (
            c["parallelism"].update(pp_engine="interleaved_1f1b", pp_virtual_stages=4),
            c["training"].update(batch_accumulation_per_replica=4),
        ),
        [],
        ["model.num_layers", "pp_virtual_stages"],
    ),
    (
        "1f1b-few-microbatches",
        lambda c: c["training"].update(batch_accumulation_per_replica=1),
        [],
        ["batch_accumulation_per_replica", "1f1b"],
    ),
    (
        "interleaved-m",
        lambda c: (
            c["parallelism"].update(pp_engine="interleaved_1f1b", pp_virtual_stages=2),
            c["training"].update(batch_accumulation_per_replica=3),
        ),
        [],
        ["batch_accumulation_per_replica", "multiple of parallelism.pp"],
    ),
    (
        "virtual-needs-interleaved",
        lambda c: c["parallelism"].update(pp_virtual_stages=2),
        [],
        ["pp_virtual_stages", "interleaved_1f1b"],
    ),
    (
        "seq-vs-positions",
        lambda c: c["training"].update(sequence_length=512),
        [],
        ["training.sequence_length", "max_position_embeddings"],
    ),
    (
        "wsd-too-long",
        lambda c: c["optimizer"].update(lr_decay_style="wsd", decay_fraction=0.95),
        [],
        ["optimizer.warmup_steps (20)", "decay_fraction=0.95", "lower warmup_steps or decay_fraction"],
    ),
    (
        "wsd-fraction-zero",
        lambda c: c["optimizer"].update(lr_decay_style="wsd", decay_fraction=0.0),
        [],
        ["optimizer.decay_fraction", "above 0"],
    ),
    (
        "wsd-bad-shape",
        lambda c: c["optimizer"].update(lr_decay_style="wsd", decay_shape="cosine"),
        [],
        ["optimizer.decay_shape", "'1-sqrt'"],
    ),
    (
        "mix-weight-zero",
        lambda c: c["data"].update(sources=[{"name": "a", "source": "stdlib", "weight": 0}]),
        [],
        ["data.sources[0].weight", "above 0"],
    ),
    (
        "mix-weight-negative",
        lambda c: c["data"].update(sources=[{"name": "a", "source": "stdlib", "weight": -1}]),
        [],
        ["data.sources[0].weight", "above 0"],
    ),
    (
        "mix-duplicate-name",
        lambda c: c["data"].update(sources=[{"name": "a", "source": "stdlib"}, {"name": "a", "source": "stdlib"}]),
        [],
        ["data.sources[1].name", "used twice"],
    ),
    (
        "mix-missing-source",
        lambda c: c["data"].update(sources=[{"name": "a"}]),
        [],
        ["data.sources[0].source", "missing"],
    ),
    (
        "mix-missing-name",
        lambda c: c["data"].update(sources=[{"source": "stdlib"}]),
        [],
        ["data.sources[0].name", "needs a name"],
    ),
    (
        "mix-unknown-key",
        lambda c: c["data"].update(sources=[{"name": "a", "source": "stdlib", "wieght": 1}]),
        [],
        ["data.sources[0].wieght", "did you mean 'weight'"],
    ),
    (
        "mix-and-source",
        lambda c: c["data"].update(source="x.jsonl", sources=[{"name": "a", "source": "stdlib"}]),
        [],
        ["data.source", "data.sources are both set"],
    ),
    (
        "mix-source-absent",
        lambda c: c["data"].update(
            sources=[{"name": "a", "source": "stdlib"}, {"name": "b", "source": "/nonexistent/x.jsonl"}]
        ),
        [],
        ["data.sources[1].source", "no such file"],
    ),
    (
        "mix-source-empty",
        lambda c: (
            open("empty.jsonl", "w").close(),  # in the test's tmp cwd
            c["data"].update(sources=[{"name": "e", "source": "empty.jsonl"}]),
        ),
        [],
        ["data.sources[0].source", "is empty"],
    ),
    (
        "val-source-absent",
        lambda c: c["data"].update(validation={"source": "/nonexistent/v.jsonl"}),
        [],
        ["data.validation.source", "no such file"],
    ),
    (
        "val-fraction-one",
        lambda c: c["data"].update(validation={"fraction": 1.0}),
        [],
        ["data.validation.fraction", "below 1"],
    ),
    (
        "val-both",
        lambda c: c["data"].update(validation={"fraction": 0.1, "source": "stdlib"}),
        [],
        ["data.validation", "exactly one"],
    ),
    (
        "eval-batches-zero",
        lambda c: (
            c["data"].update(validation={"fraction": 0.1}),
            c["training"].update(eval_interval=5, eval_batches=0),
        ),
        [],
        ["training.eval_batches is 0", "eval_interval: 0"],
    ),
    (
        "eval-needs-validation",
        lambda c: c["training"].update(eval_interval=5),
        [],
        ["training.eval_interval (5) needs data.validation"],
    ),
    ("min-lr-above-lr", lambda c: c["optimizer"].update(min_lr=1.0), [], ["optimizer.min_lr", "optimizer.lr"]),
    (
        "world-not-multiple",
        lambda c: (c["parallelism"].update(dp=3), c["slurm"].update(tasks_per_node=8)),
        [],
        ["dp*tp*pp*cp*ep = 3*2*2*1*1 = 12", "not a multiple of slurm.tasks_per_node (8)"],
    ),
    ("cpu-cluster-needs-tasks", lambda c: c["slurm"].update(tasks_per_node=None), [], ["slurm.tasks_per_node"]),
    (
        "tasks-vs-gpus",
        lambda c: c["slurm"].update(gpus_per_node=4, tasks_per_node=2),
        [],
        ["slurm.tasks_per_node", "gpus_per_node"],
    ),
    (
        "world-below-node",
        lambda c: (c["parallelism"].update(dp=1, tp=1, pp=1),),
        [],
        ["smaller than slurm.tasks_per_node"],
    ),
    ("partition-injection", lambda c: c["slurm"].update(partition="debug; rm -rf /"), [], ["slurm.partition"]),
    ("account-injection", lambda c: c["slurm"].update(account="$(whoami)"), [], ["slurm.account"]),
    ("run-name-path", lambda c: c["logging"].update(run_name="../escape"), [], ["logging.run_name"]),
    ("setup-newline", lambda c: c["slurm"].update(setup=["module load x\nrm -rf /"]), [], ["slurm.setup[0]"]),
    ("env-key", lambda c: c["slurm"].update(env={"BAD-KEY": "1"}), [], ["slurm.env.BAD-KEY"]),
    ("env-newline", lambda c: c["slurm"].update(env={"NCCL_DEBUG": "INFO\necho pwned"}), [], ["slurm.env.NCCL_DEBUG"]),
    (
        "sbatch-extra-derived",
        lambda c: c["slurm"].update(sbatch_extra={"nodes": "4"}),
        [],
        ["slurm.sbatch_extra.nodes", "sets this option itself"],
    ),
    (
        "sbatch-extra-key",
        lambda c: c["slurm"].update(sbatch_extra={"Mail Type": "END"}),
        [],
        ["slurm.sbatch_extra.Mail Type"],
    ),
    ("bad-signal", lambda c: c["slurm"].update(signal="KILL"), [], ["slurm.signal", "'USR2'"]),
    ("null-required", lambda c: c["training"].update(seed=None), [], ["training.seed", "null"]),
    # non-finite and out-of-range numbers (issue 17, item 4): NaN fails every comparison, so each
    # float field is checked for finiteness before its range
    *[
        (
            f"nonfinite-{section}.{name}-{text}",
            (lambda s, n, t: lambda c: c.setdefault(s, {}).update({n: t}))(section, name, value),
            [],
            [f"{section}.{name}", "not a finite number"],
        )
        for section, name in [
            ("model", "init_std"),
            ("model", "rms_norm_eps"),
            ("model", "rope_theta"),
            ("optimizer", "lr"),
            ("optimizer", "clip_grad"),
            ("optimizer", "weight_decay"),
            ("optimizer", "eps"),
            ("optimizer", "min_lr"),
            ("slurm", "mem_gb"),
            ("slurm", "gpu_memory_gb"),
        ]
        for text, value in [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))]
    ],
    (
        "nonfinite-betas",
        lambda c: c["optimizer"].update(betas=[float("nan"), 0.95]),
        [],
        ["optimizer.betas[0]", "not a finite number"],
    ),
    ("nonfinite-string-form", lambda c: c["optimizer"].update(lr="1e999"), [], ["optimizer.lr", "not a finite number"]),
    ("int-digits", lambda c: c["optimizer"].update(lr=10**400), [], ["invalid YAML at line", "401 digits"]),
    ("init-std-huge", lambda c: c["model"].update(init_std=1e30), [], ["model.init_std", "maximum 1.0"]),
    ("rope-theta-zero", lambda c: c["model"].update(rope_theta=0.0), [], ["model.rope_theta", "above 0.0"]),
    ("mem-gb-zero", lambda c: c["slurm"].update(mem_gb=0), [], ["slurm.mem_gb", "above 0.0"]),
    ("mem-gb-huge", lambda c: c["slurm"].update(mem_gb=1e300), [], ["slurm.mem_gb", "maximum"]),
    ("eps-negative", lambda c: c["optimizer"].update(eps=-1e-8), [], ["optimizer.eps", "minimum"]),
    ("int-huge", lambda c: c["training"].update(train_steps=10**20), [], ["training.train_steps", "maximum"]),
    ("dp-huge", lambda c: c["parallelism"].update(dp=10**9), [], ["parallelism.dp", "maximum"]),
    ("world-huge", lambda c: c["parallelism"].update(dp=2**19, tp=4), [], ["parallelism:", "at most 1,048,576"]),
    ("signal-delay-huge", lambda c: c["slurm"].update(signal_delay_s=70000), [], ["slurm.signal_delay_s", "65535"]),
    ("time-huge", lambda c: c["slurm"].update(time=10**7), [], ["slurm.time", "maximum"]),
    # strings: control characters anywhere, absurd lengths, over-long names (item 7)
    ("string-nul", lambda c: c["data"].update(source="corpus\x00.jsonl"), [], ["data.source", "control character"]),
    ("string-surrogate", lambda c: c["logging"].update(dir="logs\udc80"), [], ["logging.dir", "lone surrogate"]),
    (
        "string-huge",
        lambda c: c["data"].update(text_column="x" * 100_000),
        [],
        ["data.text_column", "100,000 characters"],
    ),
    ("run-name-300", lambda c: c["logging"].update(run_name="r" * 300), [], ["logging.run_name", "300 characters"]),
    ("huge-unknown-key", lambda c: c["model"].update({"k" * 100_000: 1}), [], ["model.kkkk", "unknown key"]),
    # sbatch_extra that would break the job (item 10), including getopt abbreviations
    (
        "sbatch-extra-wrap",
        lambda c: c["slurm"].update(sbatch_extra={"wrap": "hostname"}),
        [],
        ["slurm.sbatch_extra.wrap", "--wrap", "replaces the batch script"],
    ),
    (
        "sbatch-extra-wrap-abbrev",
        lambda c: c["slurm"].update(sbatch_extra={"wra": "hostname"}),
        [],
        ["slurm.sbatch_extra.wra", "--wrap", "abbreviation"],
    ),
    (
        "sbatch-extra-array",
        lambda c: c["slurm"].update(sbatch_extra={"array": "0-3"}),
        [],
        ["slurm.sbatch_extra.array", "same run"],
    ),
    (
        "sbatch-extra-wait",
        lambda c: c["slurm"].update(sbatch_extra={"wait": "true"}),
        [],
        ["slurm.sbatch_extra.wait", "block"],
    ),
    (
        "sbatch-extra-export",
        lambda c: c["slurm"].update(sbatch_extra={"export": "NONE"}),
        [],
        ["slurm.sbatch_extra.export", "slurm.env"],
    ),
    (
        "sbatch-extra-mem-per-cpu",
        lambda c: c["slurm"].update(sbatch_extra={"mem_per_cpu": "2G"}),
        [],
        ["slurm.sbatch_extra.mem_per_cpu", "slurm.mem_gb"],
    ),
    (
        "sbatch-extra-gpus-per-task",
        lambda c: c["slurm"].update(sbatch_extra={"gpus-per-task": "1"}),
        [],
        ["slurm.sbatch_extra.gpus-per-task", "sets this option itself"],
    ),
    # --local: a process cap (item 10)
    (
        "local-process-cap",
        lambda c: c["parallelism"].update(dp=100_000),
        ["--local"],
        ["400,000 local processes", "at most"],
    ),
    # command-line inputs
    ("set-no-equals", None, ["--set", "parallelism.tp"], ["--set", "section.field=value"]),
    ("set-unknown-key", None, ["--set", "training.steps=10"], ["training.steps", "did you mean 'train_steps'"]),
    ("set-unknown-section", None, ["--set", "train.train_steps=10"], ["unknown section 'train'"]),
    ("set-no-section", None, ["--set", "tp=2"], ["section.field=value"]),
    ("set-bad-type", None, ["--set", "parallelism.tp=two"], ["parallelism.tp", "integer"]),
    ("set-subkey-on-scalar", None, ["--set", "parallelism.tp.x=1"], ["has no sub-keys"]),
    ("set-bad-yaml", None, ["--set", "slurm.setup=[unclosed"], ["slurm.setup", "not valid YAML"]),
    ("emit-and-local", None, ["--emit", "somewhere", "--local"], ["--emit", "--local"]),
    ("dry-run-and-emit", None, ["--dry-run", "--emit", "x"], ["not allowed with argument"]),
    ("unknown-flag", None, ["--frobnicate"], ["unrecognized arguments"]),
    # data errors are found before any process starts or any job is submitted
    ("data-missing-path", lambda c: c["data"].update(source="/nonexistent/corpus.jsonl"), [], ["data.source"]),
    (
        "data-missing-tokenizer",
        lambda c: c["data"].update(tokenizer="/nonexistent/tokenizer.json"),
        [],
        ["data.tokenizer"],
    ),
    (
        "zero-shard-size-stage-0",
        lambda c: c["optimizer"].update(zero_shard_size=2, zero_stage=0),
        [],
        ["optimizer.zero_shard_size (2)", "optimizer.zero_stage 1, 2 or 3"],
    ),
    (
        "zero-shard-size-not-a-divisor",
        lambda c: c["optimizer"].update(zero_shard_size=3, zero_stage=3),
        [],
        ["optimizer.zero_shard_size (3) must divide dp x cp x ep"],
    ),
    ("zero-shard-size-one", lambda c: c["optimizer"].update(zero_shard_size=1, zero_stage=3), [], ["zero_shard_size"]),
]


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys, monkeypatch):
    _, mutate, extra, fragments = case
    monkeypatch.chdir(tmp_path)  # nothing may be written; a stray run dir would land here
    config = write_config(tmp_path, mutate) if mutate else TINY
    code, out, err = run_cli([config, "--dry-run", *extra] if "--emit" not in extra else [config, *extra], capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert not (tmp_path / "logs").exists() and not (tmp_path / "somewhere").exists()


def test_missing_config_file(capsys, tmp_path):
    code, _, err = run_cli([tmp_path / "nope.yaml", "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: config file") and "not found" in err


def test_invalid_yaml(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("parallelism:\n  dp: [1\n")
    code, _, err = run_cli([path, "--dry-run"], capsys)
    assert code == 2 and "invalid YAML at line" in err and len(err.strip().splitlines()) == 1


def test_real_process_exit_code_and_no_traceback(tmp_path):
    """The same through a real `python submit.py` process: exit status 2, no traceback, no sbatch."""
    bad = write_config(tmp_path, lambda c: c["parallelism"].update(tp=3))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), str(bad)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: model.num_attention_heads (4) must be divisible by parallelism.tp (3)")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "logs").exists()


def test_data_missing_text_column(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"content": "hello"}\n{"content": "world"}\n')
    code, _, err = run_cli([TINY, "--dry-run", "--set", f"data.source={corpus}"], capsys)
    assert code == 2 and err.startswith("error: ") and "text" in err and "content" in err, err


def test_resume_errors(tmp_path, capsys):
    code, _, err = run_cli(["--resume", tmp_path], capsys)
    assert code == 2 and "not a run directory" in err
    code, _, err = run_cli([TINY, "--resume", tmp_path], capsys)
    assert code == 2 and "--resume takes a run directory" in err


# Whole files that are not a plain YAML document (issue 17, items 5 and 8): each is one `error:`
# line naming the file and, for YAML problems, the line; the bomb answers in well under a second.
BOMB = "".join(
    f"{a}: &{a} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
    for p, a in zip([None, *"abcdefgh"], "abcdefghi")
)
TINY_TEXT = TINY.read_text()
RAW_FILES = [
    ("alias-bomb", BOMB.encode(), ["invalid YAML at line 5", "alias *d", "10,000 values"]),
    (
        "alias-bomb-in-field",
        (
            TINY_TEXT
            + "x: &x [a, a, a, a, a, a, a, a, a, a]\n"
            + "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}' if i else '*x'] * 10)}]\n" for i in range(6))
        ).encode(),
        ["invalid YAML at line", "makes the document larger"],
    ),
    ("recursive-alias", b"slurm:\n  setup: &s [a, *s]\n", ["invalid YAML at line 2", "recursive"]),
    (
        "duplicate-key",
        TINY_TEXT.replace("  dp: 2\n", "  dp: 2\n  dp: 4\n").encode(),
        ["invalid YAML at line 6", "duplicate key 'dp' (first given at line 5)"],
    ),
    (
        "duplicate-section",
        (TINY_TEXT + "parallelism:\n  dp: 8\n").encode(),
        ["duplicate key 'parallelism' (first given at line 4)"],
    ),
    ("deep-nesting", ("model: " + "[" * 5000 + "]" * 5000 + "\n").encode(), ["invalid YAML at line 1", "nested"]),
    ("binary", bytes(range(256)) * 4, ["bad.yaml: not a UTF-8 text file", "offset 128"]),
    ("nul-character", b"parallelism:\n  dp: 1\x00\n", ["bad.yaml: invalid YAML at line 2", "#x0000"]),
    ("huge-file", b"# padding\n" * 200_000, ["bad.yaml: larger than 1024 KB"]),
]


@pytest.mark.parametrize("case", RAW_FILES, ids=[c[0] for c in RAW_FILES])
def test_bad_file_exits_2_with_one_line(case, tmp_path, capsys, monkeypatch):
    _, data, fragments = case
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    start = time.process_time()  # CPU seconds: on a loaded machine wall time measures the machine
    code, out, err = run_cli([path, "--dry-run"], capsys)
    assert time.process_time() - start < 1.0
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    "value,fragment",
    [
        ("{A: '1', A: '2'}", "duplicate key 'A'"),
        ("&a [x, *a]", "recursive"),
        ("[" * 200 + "]" * 200, "nested"),
    ],
)
def test_set_value_is_strict_yaml_too(value, fragment, capsys):
    code, _, err = run_cli([TINY, "--dry-run", "--set", f"slurm.env={value}"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_aliases_within_budget_and_merges_still_work(tmp_path, capsys):
    """A config-sized alias (and a `<<:` merge that overrides a key) is fair use."""
    path = tmp_path / "ok.yaml"
    path.write_text(
        TINY_TEXT.replace("model:\n", "model:\n  num_layers: &four 4\n  num_attention_heads: *four\n")
        .replace("  num_layers: 4\n", "")
        .replace("  num_attention_heads: 4\n", "")
    )
    code, out, err = run_cli(
        [path, "--dry-run", "--set", "slurm.sbatch_extra={<<: {mail-type: END}, mail-type: FAIL}"], capsys
    )
    assert code == 0, err
    assert "--mail-type=FAIL" in out


def test_unreadable_config_names_the_file(tmp_path, capsys, monkeypatch):
    """A regular file whose read fails (permissions; root reads anything, so the failure is made
    by the open itself). /proc/self/mem, once used here, is now refused before any read: a
    config on a pseudo file system is the path checker's (tests/test_paths.py)."""
    path = tmp_path / "secret.yaml"
    path.write_text("parallelism: {dp: 1}\n")
    from nanotrain.config import loader

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(loader, "open", refuse, raising=False)
    code, _, err = run_cli([path, "--dry-run"], capsys)
    assert code == 2 and err.startswith(f"error: {path}: cannot read the config file") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "section,name,value,fragment",
    [
        ("optimizer", "lr", float("nan"), "optimizer.lr: nan is not a finite number"),
        ("model", "init_std", float("inf"), "model.init_std: inf is not a finite number"),
        ("optimizer", "betas", (0.9, float("nan")), "optimizer.betas[1]: nan is not a finite number"),
        ("slurm", "mem_gb", float("-inf"), "slurm.mem_gb: -inf is not a finite number"),
        ("parallelism", "dp", 0, "parallelism.dp: 0 is below the minimum 1"),
    ],
)
def test_validate_rechecks_fields_of_a_config_built_in_code(section, name, value, fragment):
    """A Config made in code (or changed after loading) meets the same per-field checks."""
    from nanotrain.config import Config, ConfigError, validate

    config = Config()
    setattr(getattr(config, section), name, value)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        validate(config)


def test_validate_rechecks_sub_sections_built_in_code():
    """`data.sources[i]`, `data.validation` and `slurm.prepare` meet the per-field checks too."""
    from nanotrain.config import Config, ConfigError, validate
    from nanotrain.config.schema import SourceArgs, ValidationArgs

    for mutate, fragment in [
        (
            lambda c: setattr(c.data, "sources", [SourceArgs("a", "stdlib", float("nan"))]),
            "data.sources[0].weight: nan is not a finite number",
        ),
        (
            lambda c: setattr(c.data, "validation", ValidationArgs(fraction=-0.5)),
            "data.validation.fraction: -0.5 must be above 0.0",
        ),
        (lambda c: setattr(c.slurm.prepare, "cpus", 0), "slurm.prepare.cpus: 0 is below the minimum 1"),
    ]:
        config = Config()
        mutate(config)
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            validate(config)
