"""The --dry-run memory estimate: parameter count equals the real model's, the engine's
in-flight micro-batches are counted, the GPU-memory warning fires, and a 512-node plan is fast."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.config import load_config
from nanotrain.estimate.memory import GB, describe, estimate_memory, micro_batches_in_flight

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_the_model(tied):
    from nanotrain.models.llama_parallelize import build_llama

    config = load_config(
        TINY,
        ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", f"model.tie_word_embeddings={str(tied).lower()}"],
    )
    model = build_llama(config.model, None)
    numel = sum(p.numel() for p in model.parameters())
    assert estimate_memory(config).weights * GB == pytest.approx(4 * numel)


def test_in_flight_micro_batches_follow_the_engine():
    base = ["parallelism.pp=2", "training.batch_accumulation_per_replica=8"]
    assert micro_batches_in_flight(load_config(TINY, base + ["parallelism.pp_engine=afab"])) == 8
    assert micro_batches_in_flight(load_config(TINY, base + ["parallelism.pp_engine=1f1b"])) == 2
    inter = load_config(TINY, base + ["parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=2"])
    assert micro_batches_in_flight(inter) == pytest.approx(2.5)


def test_zero1_divides_optimizer_state():
    zero0 = estimate_memory(load_config(TINY, ["optimizer.zero_stage=0"]))
    zero1 = estimate_memory(load_config(TINY, ["optimizer.zero_stage=1"]))
    assert zero1.optimizer == pytest.approx(zero0.optimizer / 2)


def test_warning_when_over_gpu_memory():
    config = load_config(ROOT / "configs" / "3d_16gpu.yaml", ["slurm.gpu_memory_gb=8"])
    lines = describe(config)
    assert lines[-1].startswith("warning: the estimate") and "slurm.gpu_memory_gb (8 GB)" in lines[-1]
    assert len(describe(load_config(ROOT / "configs" / "3d_16gpu.yaml"))) == 1


@pytest.mark.parametrize("gpu_memory", [None, 80])
def test_absurd_estimate_warns_even_without_gpu_memory(gpu_memory):
    """hidden_size 10**12 (a typo) used to pass --dry-run silently when gpu_memory_gb was unset."""
    sets = ["model.hidden_size=1000000000000", "model.intermediate_size=4000000000000"]
    if gpu_memory is not None:
        sets.append(f"slurm.gpu_memory_gb={gpu_memory}")
    lines = describe(load_config(TINY, sets))
    assert len(lines) == 2 and "e+" in lines[0]  # huge numbers in short form, not 30 digits
    assert lines[1].startswith("warning: the estimate") and "more than any accelerator holds" in lines[1]
    assert "model.hidden_size" in lines[1]


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_512_node_plan_under_2_seconds(tmp_path):
    """The planner is judged by the CPU seconds it spends (interpreter start and imports
    included), not by wall time: on a loaded CI box a process can wait seconds for a core
    or for cold files, which says nothing about the planner. Wall time is only bounded
    against hangs."""
    cpu_before = _children_cpu_seconds()
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "submit.py"),
            str(ROOT / "configs" / "3d_16gpu.yaml"),
            "--dry-run",
            "--set",
            "parallelism.dp=1024",
            "--set",
            "slurm.gpus_per_node=8",
            "--set",
            f"logging.dir={tmp_path}",
            # one global batch of 1024 replicas must fit in the config's 'stdlib' data (~12M tokens)
            "--set",
            "training.micro_batch_size=1",
            "--set",
            "training.batch_accumulation_per_replica=4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    wall = time.monotonic() - start
    cpu = _children_cpu_seconds() - cpu_before
    assert proc.returncode == 0, proc.stderr
    assert "512 node(s) x 8 tasks" in proc.stdout and "memory per GPU" in proc.stdout
    assert "#SBATCH --nodes=512" in proc.stdout
    assert cpu < 2.0, f"planning 4096 ranks took {cpu:.2f} CPU s ({wall:.2f} s wall)"


def test_context_parallel_divides_activations_and_zero_shards():
    base = [
        "parallelism.dp=1",
        "training.sequence_length=4096",
        "model.max_position_embeddings=4096",
        "optimizer.zero_stage=1",
        "slurm.gpus_per_node=8",
    ]  # on CPU cp keeps causal masks too
    one = estimate_memory(load_config(TINY, base))
    two = estimate_memory(load_config(TINY, base + ["parallelism.cp=2"]))
    assert two.optimizer == pytest.approx(one.optimizer / 2)  # ZeRO-1 shards over dp x cp
    assert one.activations / 2 < two.activations < one.activations * 0.6  # s/cp, plus gathered k/v


def test_zero2_divides_gradients_and_counts_two_full_buckets():
    """ZeRO-2: the gradients persist as this rank's shard (1/(dp x cp), as the optimizer states)
    plus the two full-size buckets alive during backward; traffic counts one reduce-scatter per
    micro-batch and the all-gather ((m + 1)(d - 1)/d of the gradient bytes)."""
    from nanotrain.estimate.comm_volume import traffic_bytes
    from nanotrain.estimate.memory import BUCKET_CAP_BYTES, zero2_bucket_bytes
    from nanotrain.models import llama_arch
    from nanotrain.parallel.data_parallel.buckets import DEFAULT_BUCKET_CAP_MB, cap_bytes

    assert BUCKET_CAP_BYTES == cap_bytes(DEFAULT_BUCKET_CAP_MB)  # the trainer's buckets

    base = ["parallelism.dp=4", "parallelism.tp=1", "parallelism.pp=1", "training.batch_accumulation_per_replica=4"]
    zero0, zero1, zero2 = (load_config(TINY, base + [f"optimizer.zero_stage={z}"]) for z in (0, 1, 2))
    e0, e1, e2 = map(estimate_memory, (zero0, zero1, zero2))
    rank = llama_arch.rank_summaries(zero2.model)[0]
    assert e2.optimizer == pytest.approx(e1.optimizer) == pytest.approx(e0.optimizer / 4)
    assert e1.grads == e0.grads
    assert e2.grads * GB == pytest.approx(e0.grads * GB / 4 + zero2_bucket_bytes(zero2, rank))
    assert "ZeRO-2 over dp4 (grads too, reduce-scattered in each of 4 micro-batch(es))" in describe(zero2)[0]
    # an 8B model at dp4: a quarter of ZeRO-1's 30 GB, plus two 2 GB buckets (the embedding alone)
    big = [*base, "model.hidden_size=4096", "model.num_layers=32", "model.num_attention_heads=32"]
    big += ["model.num_key_value_heads=8", "model.intermediate_size=14336", "model.vocab_size=128256"]
    g1, g2 = (estimate_memory(load_config(TINY, big + [f"optimizer.zero_stage={z}"])).grads for z in (1, 2))
    assert g2 < 0.4 * g1
    dp0, dp1, dp2 = (traffic_bytes(c)["dp"] for c in (zero0, zero1, zero2))
    assert dp0 == dp1 and dp2 == pytest.approx(dp1 * (4 + 1) / 2)
    one = load_config(TINY, [*base[:3], "training.batch_accumulation_per_replica=1", "optimizer.zero_stage=2"])
    assert traffic_bytes(one)["dp"] == pytest.approx(traffic_bytes(load_config(TINY, base[:3]))["dp"])


LLAMA_8B = ["model.hidden_size=4096", "model.num_layers=32", "model.num_attention_heads=32"]
LLAMA_8B += ["model.num_key_value_heads=8", "model.intermediate_size=14336", "model.vocab_size=128256"]


def test_zero3_shards_weights_and_counts_two_gathered_units():
    """ZeRO-3 at dp8: the weights persist as this rank's shard plus the two units gathered at
    once (a layer and the LM head, the largest pair here); gradients and optimizer states as
    ZeRO-2; the dp traffic is 2m all-gathers (m for the embedding and the head) and m
    reduce-scatters of the parameter bytes."""
    from nanotrain.estimate.comm_volume import traffic_bytes
    from nanotrain.estimate.memory import zero3_gathered_bytes
    from nanotrain.models import llama_arch

    base = ["parallelism.dp=8", "parallelism.tp=1", "parallelism.pp=1", "training.batch_accumulation_per_replica=4"]
    base += LLAMA_8B + ["model.tie_word_embeddings=false"]
    configs = [load_config(TINY, base + [f"optimizer.zero_stage={z}"]) for z in range(4)]
    e0, e1, e2, e3 = map(estimate_memory, configs)
    assert e3.total < e2.total < e1.total < e0.total
    assert e3.grads == e2.grads and e3.optimizer == e2.optimizer == pytest.approx(e0.optimizer / 8)
    rank = llama_arch.rank_summaries(configs[3].model)[0]
    layer = llama_arch.layer_parameters(configs[3].model, 1, 0)
    head = 4096 + 128256 * 4096  # final norm + LM head
    assert zero3_gathered_bytes(configs[3], rank) == 4 * (layer + head)
    assert e3.weights * GB == pytest.approx(e0.weights * GB / 8 + 4 * (layer + head))
    assert 6.3 < e3.weights < 6.7 and e0.weights > 29  # 8B: 29.9 GiB whole; 3.7 shard + 2.8 gathered
    line = describe(configs[3])[0]
    assert "ZeRO-3 over dp8 (grads and weights too: each layer all-gathered in forward and backward" in line
    dp = [traffic_bytes(c)["dp"] for c in configs]
    # 3m (d-1)/d of the parameter bytes, m = 4, d = 8, but the embedding and the head are gathered
    # once per micro-batch (the embedding's backward reads no weights; the head is kept into its own)
    once = 4 * 4 * 7 / 8 * (128256 * 4096 + head)
    assert dp[3] == pytest.approx(4 * e0.weights * GB / 4 * 3 * 4 * 7 / 8 - once)
    assert dp[3] == pytest.approx(dp[1] * 3 * 4 / 2 - once) and dp[2] == pytest.approx(dp[1] * (4 + 1) / 2)
    # one replica: nothing is sharded, nothing gathered
    alone = ["parallelism.dp=1" if k.startswith("parallelism.dp") else k for k in base]
    one = [estimate_memory(load_config(TINY, alone + [f"optimizer.zero_stage={z}"])) for z in (0, 3)]
    assert one[1].weights == one[0].weights


@pytest.mark.parametrize("stage, hint", [(0, "zero_stage: 1, 2 or 3"), (2, "zero_stage: 3,"), (3, None)])
def test_over_memory_warning_suggests_the_stages_above(stage, hint):
    base = ["parallelism.dp=8", "parallelism.tp=1", "parallelism.pp=1", "slurm.gpu_memory_gb=4"]
    line = describe(load_config(TINY, base + LLAMA_8B + [f"optimizer.zero_stage={stage}"]))[-1]
    assert line.startswith("warning: the estimate") and "lower training.micro_batch_size" in line
    assert (hint in line) if hint else "zero_stage" not in line, line


def test_zero3_gathers_no_expert_kept_whole():
    """dp1 x ep4: the routed experts' group is one rank, so ZeRO-3 keeps them whole (in the shard)
    and gathers only the rest of an MoE layer; at dp2 it gathers the experts too."""
    from nanotrain.estimate.memory import zero3_gathered_bytes
    from nanotrain.models import llama_arch

    sets = ["model.num_layers=4", "optimizer.zero_stage=3", "parallelism.pp=1"]
    one, two = (load_config(ROOT / "configs" / "moe_16gpu.yaml", sets + [f"parallelism.dp={d}"]) for d in (1, 2))
    m, rank = one.model, llama_arch.rank_summaries(one.model)[0]
    assert rank.moe_layers == 4 and rank.others == ("embed", "final_norm", "lm_head")
    layer = llama_arch.layer_parameters(m, 1, 0, one.parallelism.ep)
    experts = llama_arch.routed_expert_parameters(m, one.parallelism.ep)
    head = m.hidden_size + llama_arch.block_parameters(m, "lm_head")  # larger than a layer here
    assert zero3_gathered_bytes(two, rank) == 4 * (layer + head)
    assert zero3_gathered_bytes(one, rank) == 4 * (layer - experts + head)


def test_hybrid_sharding_traffic_is_block_collectives_plus_one_all_reduce_across():
    """optimizer.zero_shard_size 2 at dp4, ZeRO-3 (m = 4): the gathers and reduce-scatters run in
    blocks of 2, (2-1)/2 of the bytes each, and one all-reduce of the owned half crosses the 2
    blocks: 2 (2-1)/2 x 1/2 more; without hybrid sharding every collective moves 3/4."""
    from nanotrain.estimate.comm_volume import dp_share

    base = ["parallelism.dp=4", "parallelism.tp=1", "parallelism.pp=1", "training.batch_accumulation_per_replica=4"]
    base += ["optimizer.zero_stage=3"]
    plain, hybrid = load_config(TINY, base), load_config(TINY, base + ["optimizer.zero_shard_size=2"])
    assert dp_share(plain, 4) == pytest.approx(12 * 3 / 4)
    assert dp_share(hybrid, 4) == pytest.approx(12 * 1 / 2 + 2 * 1 / 2 / 2)


def test_hybrid_sharding_memory_and_bf16_reduction_traffic():
    """Hybrid blocks of 2 at dp4 hold half of the state, not a quarter, and --dry-run says so; a
    bf16 gradient reduction halves the reduce-scatters' bytes (ZeRO-3: m of its 3m collectives),
    bf16 autocast the gathers' (2m of them)."""
    from nanotrain.estimate.comm_volume import dp_share

    base = ["parallelism.dp=4", "parallelism.tp=1", "parallelism.pp=1", "training.batch_accumulation_per_replica=4"]
    base += ["optimizer.zero_stage=3"]
    plain, hybrid = load_config(TINY, base), load_config(TINY, base + ["optimizer.zero_shard_size=2"])
    assert estimate_memory(hybrid).optimizer == pytest.approx(2 * estimate_memory(plain).optimizer)
    assert "ZeRO-3 over blocks of 2 of dp4 (hybrid" in describe(hybrid)[0]
    bf16 = load_config(TINY, base + ["optimizer.grad_reduce_dtype=bfloat16"])
    assert dp_share(bf16, 4) == pytest.approx((12 - 2) * 3 / 4)
    # under bf16 autocast ZeRO-3's 2m gathers send bf16 too
    autocast = load_config(TINY, base + ["model.dtype=bfloat16"])
    assert dp_share(autocast, 4) == pytest.approx((12 - 4) * 3 / 4)
