"""`submit.py CONFIG --plan [--gpus N] [--gpu-memory-gb G]`: choose the layout for the user.

Every layout of N GPUs that keeps the config's global batch (micro_batch_size x
batch_accumulation_per_replica x dp samples) is enumerated: (dp, tp, pp, cp, pipeline engine and
virtual stages, tp mode, micro-batch size, accumulation, recompute, ZeRO stage). Memory comes only
from ``memory.estimate_memory`` on each candidate config (one source of arithmetic, so
the plan follows every change of the estimate); a layout fits when that estimate is at most
``G x (1 - MARGIN) - RESERVED_GB`` (the estimate leaves out the CUDA context, communication
buffers and fragmentation). The fitting layouts are ranked by ``step_time`` (its cost model:
that docstring; for users, the README's ``--plan`` section), and the best few that pass the real
validation (``config.validate``) are printed as ready ``--set`` lines. Nothing is proposed that
validation rejects.
"""

from __future__ import annotations

import copy
import dataclasses
import shlex
from dataclasses import dataclass

from nanotrain.config import Config, ConfigError, validate
from nanotrain.config.schema import MAX_WORLD
from nanotrain.estimate.comm_volume import cp_collectives_per_layer, dp_rounds, tp_collectives_per_layer, traffic_bytes
from nanotrain.estimate.memory import estimate_memory
from nanotrain.models import llama_arch, llama_parallelize_costs

MARGIN = 0.10  # of the GPU's memory, kept free
RESERVED_GB = 2.0  # CUDA context, NCCL buffers, allocator fragmentation: outside the estimate
DEFAULT_GPU_MEMORY_GB = 80.0
DEFAULT_GPUS_PER_NODE = 8  # when the config is a CPU one (slurm.gpus_per_node: 0)
MAX_MICRO_BATCH = 64
MAX_PLAN_GPUS = 262144  # the largest count "what would help" searches
# Matmuls of few rows reach less of the peak: efficiency x rows / (rows + this), rows = tokens of
# one micro-batch on one rank (micro_batch_size x sequence_length / cp).
SMALL_MATMUL_TOKENS = 256
SHOWN = 5


@dataclass(frozen=True)
class Hardware:
    """What the cost model assumes of one GPU and its links (bytes/s are per GPU, one way)."""

    peak_tflops: float = 989.0  # H100 SXM, bf16 dense
    efficiency: float = 0.5  # fraction of peak a matmul-bound step reaches
    intra_node_gbs: float = 300.0  # NVLink, achieved ring bus bandwidth
    inter_node_gbs: float = 40.0  # 400 Gb/s InfiniBand per GPU, achieved
    latency_us: float = 20.0  # per step of a ring collective or point-to-point message
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE


@dataclass(frozen=True)
class Proposal:
    config: Config
    memory_gb: float
    step_s: float
    tokens_per_s: float
    mfu: float
    parts: dict

    def set_args(self) -> list[str]:
        p, t = self.config.parallelism, self.config.training
        fields = [
            ("parallelism.dp", p.dp),
            ("parallelism.tp", p.tp),
            ("parallelism.pp", p.pp),
            ("parallelism.cp", p.cp),
            ("parallelism.pp_engine", p.pp_engine),
            ("parallelism.pp_virtual_stages", p.pp_virtual_stages),
            ("parallelism.tp_mode", p.tp_mode),
            ("training.micro_batch_size", t.micro_batch_size),
            ("training.batch_accumulation_per_replica", t.batch_accumulation_per_replica),
            ("training.recompute", t.recompute),
            ("optimizer.zero_stage", self.config.optimizer.zero_stage),
        ]
        return [f"--set {k}={v}" for k, v in fields]

    def summary(self) -> str:
        p, t = self.config.parallelism, self.config.training
        virtual = f" v{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else ""
        engine = "" if p.pp == 1 else f" {p.pp_engine}{virtual}"
        mode = " SP" if p.tp > 1 and p.tp_mode == "REDUCE_SCATTER" else ""
        return (
            f"dp{p.dp} tp{p.tp}{mode} pp{p.pp}{engine} cp{p.cp} mbs{t.micro_batch_size} "
            f"acc{t.batch_accumulation_per_replica} recompute={t.recompute} "
            f"zero{self.config.optimizer.zero_stage}"
        )


def gb(value: float) -> str:
    """GB as printed: one decimal, or three significant digits below 1 GB (tiny models)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def _divisors_up_to(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` up to ``limit``: ``limit`` steps whatever ``n`` is (a global batch of
    2**53 samples has ~10**8 candidates below its square root)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _bandwidth(span: int, hw: Hardware) -> float:
    return hw.intra_node_gbs if span <= hw.gpus_per_node else hw.inter_node_gbs


def step_time(config: Config, hw: Hardware) -> tuple[float, float, dict]:
    """(step seconds, model FLOPs per step, the parts) of ``config``'s layout on ``hw``.

    Cost model (per optimizer step, nothing overlapped: an upper bound that ranks layouts):
    - compute: the hardware FLOPs of the step (model FLOPs, ``llama_arch.training_flops_per_token``,
      plus what recomputation re-runs: ``full`` one more forward of every layer, ``selective`` the
      attention core's forward; the SwiGLU activation is elementwise, no matmul FLOPs; the chunked
      loss, ``training.loss_chunk_tokens``, the LM head's forward) over
      N GPUs at ``efficiency`` x ``peak`` FLOP/s, times rows / (rows + SMALL_MATMUL_TOKENS) for
      the few rows of a small micro-batch (rows = micro_batch_size x sequence_length / cp);
    - pipeline bubble: compute x (pp - 1) / (v x m) for 1f1b and afab (v = 1) and interleaved 1f1b
      with v virtual stages, m = batch_accumulation_per_replica;
    - tp: per layer and micro-batch, 4 all-reduces (ALL_REDUCE) or 4 all-gather/reduce-scatter pairs
      (REDUCE_SCATTER, the same volume) of the b x s/cp x h activation in the compute dtype (bf16
      under autocast), 5 under full recompute, each moving 2 (t - 1)/t of it (ring);
    - cp (keys and values all-gathered, ``context_parallel.py``): per layer and micro-batch, the
      all-gather of this rank's K and V in forward (again under full recompute) and the
      reduce-scatter of their gradients in backward, (cp - 1) chunks each;
    - pp: each micro-batch's activation and its gradient crossing each stage boundary (a rank of
      an end stage sends one of the two for one of its chunks);
    - dp: the fp32 gradient all-reduce over dp x cp (ZeRO-1: reduce-scatter plus all-gather, the
      same volume) of this rank's parameters, 2 (d - 1)/d of them; ZeRO-2 reduce-scatters every
      micro-batch, (m + 1)(d - 1)/d of them; ZeRO-3 gathers every layer twice and reduce-scatters
      per micro-batch, 3m (d - 1)/d (``comm_volume.dp_rounds``), each collective's latency too;
    - every ring step and message also costs ``latency_us``; a group uses the intra-node bandwidth
      when it fits in one node (ranks are laid out tp fastest, then cp, dp, pp), the inter-node
      bandwidth otherwise.
    MFU is model FLOPs (recomputation excluded) over step time x N x peak.
    The figures (peak, efficiency, bandwidths) are ``Hardware``'s defaults, an H100 node with
    400 Gb/s per GPU across nodes; set them with ``--gpu-tflops``, ``--efficiency``,
    ``--intra-node-gbs`` and ``--inter-node-gbs``."""
    m, p, t = config.model, config.parallelism, config.training
    n = p.world_size
    seq, b, acc = t.sequence_length, t.micro_batch_size, t.batch_accumulation_per_replica
    tokens = seq * global_batch(config)
    model_flops = llama_arch.training_flops_per_token(m, seq) * tokens
    chunked = llama_parallelize_costs.head_chunk_rows(config) > 0  # the chunked loss reruns the LM head
    hardware_flops = llama_parallelize_costs.hardware_flops_per_token(m, seq, t.recompute, chunked) * tokens
    local = b * (seq // p.cp)  # tokens of one micro-batch on one rank: the matmuls' rows
    efficiency = hw.efficiency * local / (local + SMALL_MATMUL_TOKENS)
    compute = hardware_flops / (n * hw.peak_tflops * 1e12 * efficiency)
    parts = {"compute": compute, "bubble": compute * (p.pp - 1) / (p.pp_virtual_stages * acc)}
    sent = traffic_bytes(config)
    layers = -(-m.num_layers // p.pp)
    latency = hw.latency_us * 1e-6
    ring_steps = lambda group: 2 * (group - 1)  # noqa: E731 - latency-bound steps of one ring
    parts["tp"] = tp_collectives_per_layer(t.recompute) * layers * acc * ring_steps(p.tp) * latency + sent["tp"] / (
        _bandwidth(p.tp, hw) * 1e9
    )
    parts["cp"] = cp_collectives_per_layer(t.recompute) * (p.cp - 1) * layers * acc * latency + sent["cp"] / (
        _bandwidth(p.tp * p.cp, hw) * 1e9
    )
    messages = 0 if p.pp == 1 else 2 * p.pp_virtual_stages * acc
    parts["pp"] = messages * latency + sent["pp"] / (_bandwidth(n, hw) * 1e9)
    dp_collectives = dp_rounds(config) / 2  # in all-reduces' steps
    parts["dp"] = dp_collectives * ring_steps(p.dp * p.cp) * latency + sent["dp"] / (
        _bandwidth(p.tp * p.cp * p.dp, hw) * 1e9
    )
    return sum(parts.values()), model_flops, parts


def _with(config: Config, **sections) -> Config:
    out = copy.copy(config)
    for name, values in sections.items():
        setattr(out, name, dataclasses.replace(getattr(config, name), **values))
    return out


def _grids(config: Config, gpus: int, hw: Hardware):
    """(tp, cp, pp, dp) of ``gpus`` with dp dividing the global batch (tp within a node)."""
    m, t = config.model, config.training
    for tp in (d for d in _divisors(gpus) if d <= hw.gpus_per_node and m.num_attention_heads % d == 0):
        for cp in (d for d in _divisors(gpus // tp) if t.sequence_length % (2 * d) == 0 or d == 1):
            for pp in (d for d in _divisors(gpus // (tp * cp)) if d <= m.num_layers):
                dp = gpus // (tp * cp * pp)
                if global_batch(config) % dp == 0:
                    yield tp, cp, pp, dp


def global_batch(config: Config) -> int:
    t = config.training
    return t.micro_batch_size * t.batch_accumulation_per_replica * config.parallelism.dp


def _engines(config: Config, pp: int, acc: int) -> list[tuple[str, int]]:
    engines = [("1f1b", 1)] if pp == 1 else [("afab", 1)] if acc < pp else [("1f1b", 1)]
    if pp > 1 and acc % pp == 0:
        engines += [("interleaved_1f1b", v) for v in (2, 4) if config.model.num_layers >= pp * v]
    return engines


def _layout(config: Config, tp, cp, pp, dp, engine, v, mode, mbs, acc, recompute, zero) -> Config:
    return _with(
        config,
        parallelism=dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=1, pp_engine=engine, pp_virtual_stages=v, tp_mode=mode),
        training=dict(micro_batch_size=mbs, batch_accumulation_per_replica=acc, recompute=recompute),
        optimizer=dict(zero_stage=zero),
    )


def candidates(config: Config, gpus: int, hw: Hardware):
    """Every layout of ``gpus`` that keeps the global batch (structurally; validation decides)."""
    batch = global_batch(config)
    for tp, cp, pp, dp in _grids(config, gpus, hw):
        zeros = (0, 1, 2, 3) if dp * cp > 1 else (0,)  # one replica: ZeRO shards nothing
        for mbs in _divisors_up_to(batch // dp, MAX_MICRO_BATCH):
            acc = batch // (dp * mbs)
            for engine, v in _engines(config, pp, acc):
                for mode in ("ALL_REDUCE", "REDUCE_SCATTER") if tp > 1 else (config.parallelism.tp_mode,):
                    for recompute in llama_parallelize_costs.RECOMPUTE_MODES:
                        for zero in zeros:
                            yield _layout(config, tp, cp, pp, dp, engine, v, mode, mbs, acc, recompute, zero)


def fewest_gpus(config: Config, gpus: int, budget: float, hw: Hardware, slurm: bool) -> int | None:
    """The smallest gpus x 2**k (up to ``MAX_PLAN_GPUS``) where some valid layout fits, trying
    only the leanest variant of each grid (one micro-sample per micro-batch, ZeRO-3, sequence
    parallelism, full recompute, the engine with the fewest micro-batches in flight)."""
    batch, n = global_batch(config), gpus * 2
    while n <= MAX_PLAN_GPUS:
        for tp, cp, pp, dp in _grids(config, n, hw):
            acc = batch // dp
            mode = "REDUCE_SCATTER" if tp > 1 and (config.training.sequence_length // cp) % tp == 0 else "ALL_REDUCE"
            zero = 3 if dp * cp > 1 else 0
            cand = _layout(config, tp, cp, pp, dp, *_engines(config, pp, acc)[0], mode, 1, acc, "full", zero)
            try:
                fits = estimate_memory(cand).total <= budget
            except ValueError:
                continue
            if fits and _valid(cand, slurm) is None:
                return n
        n *= 2
    return None


def _valid(config: Config, slurm: bool) -> str | None:
    """None when the real validation accepts ``config``, else its message."""
    try:
        validate(config, slurm=slurm)
    except ConfigError as exc:
        return str(exc)
    return None


@dataclass
class Plan:
    gpus: int
    budget_gb: float
    hw: Hardware
    proposals: list
    smallest: tuple | None  # (memory GB, summary) of the leanest valid layout, when none fits
    rejected: str | None  # a validation message, when every layout that fits was rejected
    count: int
    fewest: int | None = None  # when none fits: the fewest GPUs (gpus x 2**k) where one would


def make_plan(config: Config, gpus: int, gpu_memory_gb: float, hw: Hardware, shown: int = SHOWN) -> Plan:
    """The ``shown`` fastest valid layouts of ``gpus`` GPUs that keep ``config``'s global batch and
    fit ``gpu_memory_gb`` (module doc), or, when none fits, the leanest valid layout and the fewest
    GPUs at which one would (``Plan.smallest``, ``Plan.fewest``). Check the request first with
    ``check_request``; ``render`` and ``explain_none`` turn the plan into lines."""
    budget = gpu_memory_gb * (1 - MARGIN) - RESERVED_GB
    slurm = config.slurm.gpus_per_node > 0
    # A node range ('min-max') is the config's own size; each candidate is a job of its own count.
    config = _with(config, slurm=dict(nodes=None))
    scored, leanest, count = [], [], 0
    for cand in candidates(config, gpus, hw):
        count += 1
        try:
            est = estimate_memory(cand)
        except ValueError:  # a shape the layout cannot shard (llama_arch says why); validation would too
            continue
        if est.total > budget:
            leanest.append((est.total, cand))
            continue
        seconds, flops, parts = step_time(cand, hw)
        scored.append((seconds, est.total, cand, flops, parts))
    scored.sort(key=lambda s: (s[0], s[1]))
    proposals, rejected, seen = [], None, {}
    for seconds, mem, cand, flops, parts in scored:
        p, t = cand.parallelism, cand.training
        key = (p.dp, p.tp, p.pp, p.cp, p.pp_engine, p.pp_virtual_stages, t.micro_batch_size)
        if mem >= seen.get(key, float("inf")):  # a faster variant (ZeRO stage, tp mode, recompute)
            continue  # of this layout is shown already, with no more memory: no news
        problem = _valid(cand, slurm)
        if problem is not None:
            rejected = rejected or problem
            continue
        seen[key] = mem
        tokens = t.sequence_length * global_batch(cand)
        proposals.append(
            Proposal(cand, mem, seconds, tokens / seconds, flops / (seconds * gpus * hw.peak_tflops * 1e12), parts)
        )
        if len(proposals) == shown:
            break
    smallest = None
    if not proposals:
        for mem, cand in sorted(leanest, key=lambda x: x[0]):
            problem = _valid(cand, slurm)
            if problem is None:
                smallest = (mem, Proposal(cand, mem, 0, 0, 0, {}).summary())
                break
            rejected = rejected or problem
    fewest = fewest_gpus(config, gpus, budget, hw, slurm) if smallest is not None else None
    return Plan(gpus, budget, hw, proposals, smallest, rejected, count, fewest)


def check_request(config: Config, gpus: int | None, gpu_memory_gb: float | None) -> tuple[int, float]:
    """The GPU count and memory to plan for, or a ConfigError naming the flag and the fix."""
    gpus = config.parallelism.world_size if gpus is None else gpus
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: plan for at least 1 GPU (e.g. --gpus 8)")
    if gpus > MAX_WORLD:
        raise ConfigError(f"--gpus {gpus:,}: at most {MAX_WORLD:,} ranks are supported")
    per_node = config.slurm.gpus_per_node
    if per_node and gpus % per_node:
        lower = f"{gpus - gpus % per_node} or " if gpus > per_node else ""
        raise ConfigError(
            f"--gpus {gpus} is not a multiple of slurm.gpus_per_node ({per_node}): plan for "
            f"{lower}{gpus + per_node - gpus % per_node} GPUs, or --set slurm.gpus_per_node=<a divisor>"
        )
    memory = gpu_memory_gb if gpu_memory_gb is not None else (config.slurm.gpu_memory_gb or DEFAULT_GPU_MEMORY_GB)
    if not memory > 0 or memory != memory or memory == float("inf"):
        raise ConfigError(f"--gpu-memory-gb {memory:g}: give the memory of one GPU in GB (e.g. 80)")
    if memory * (1 - MARGIN) - RESERVED_GB <= 0:
        raise ConfigError(
            f"--gpu-memory-gb {memory:g}: nothing is left after the {RESERVED_GB:g} GB reserve "
            f"and {MARGIN:.0%} margin; give at least {RESERVED_GB / (1 - MARGIN) + 0.1:.1f}"
        )
    return gpus, memory


FLAGS = {
    "peak_tflops": "--gpu-tflops",
    "efficiency": "--efficiency",
    "intra_node_gbs": "--intra-node-gbs",
    "inter_node_gbs": "--inter-node-gbs",
}


def hardware(config: Config, **figures) -> Hardware:
    """``Hardware`` with the node size of the config and the figures given (None = default),
    keyed as its fields; a bad figure is a ConfigError naming its flag (``FLAGS``)."""
    given = {k: v for k, v in figures.items() if v is not None}
    for name, value in given.items():
        if not 0 < value < float("inf") or (name == "efficiency" and value > 1):
            hint = "a fraction of peak in (0, 1], e.g. 0.5" if name == "efficiency" else "a positive number"
            raise ConfigError(f"{FLAGS[name]} {value:g}: must be {hint}")
    return Hardware(gpus_per_node=config.slurm.gpus_per_node or DEFAULT_GPUS_PER_NODE, **given)


def render(plan: Plan, config_arg: str, gpu_memory_gb: float, user_sets: list[str] = ()) -> list[str]:
    """The plan's lines; each proposal's command repeats the user's own ``--set`` overrides first."""
    hw = plan.hw
    own = "".join(f" --set {shlex.quote(s)}" for s in user_sets)
    lines = [
        f"plan: {plan.gpus} GPUs ({hw.gpus_per_node} per node), {gpu_memory_gb:g} GB each; a layout fits "
        f"when its estimate is <= {plan.budget_gb:.1f} GB ({MARGIN:.0%} margin, {RESERVED_GB:g} GB reserved); "
        f"{plan.count} layouts keep the global batch",
        f"cost model: {hw.peak_tflops:g} TFLOP/s peak per GPU at {hw.efficiency:.0%} efficiency; links "
        f"{hw.intra_node_gbs:g} GB/s within a node, {hw.inter_node_gbs:g} GB/s across nodes "
        "(--gpu-tflops, --efficiency, --intra-node-gbs, --inter-node-gbs)",
    ]
    for i, prop in enumerate(plan.proposals, 1):
        parts = ", ".join(f"{k} {v:.3g}" for k, v in prop.parts.items() if v > 0)
        lines += [
            f"#{i} {prop.summary()}: memory {gb(prop.memory_gb)} GB, step {prop.step_s:.3g} s ({parts}), "
            f"{prop.tokens_per_s:,.0f} tokens/s, MFU {prop.mfu:.1%}",
            f"   python submit.py {shlex.quote(config_arg)}{own} " + " ".join(prop.set_args()),
        ]
    return lines


def explain_none(plan: Plan, config: Config) -> str:
    """The one line for a plan with nothing to propose: why, and what would help."""
    if plan.smallest is not None:
        mem, layout = plan.smallest
        more = f"--gpus {plan.fewest:,} fits" if plan.fewest else f"no count up to {MAX_PLAN_GPUS:,} GPUs fits"
        return (
            f"no layout of {plan.gpus} GPUs fits: the leanest valid one ({layout}) needs {mem:.1f} GB "
            f"per GPU, over the {plan.budget_gb:.1f} GB usable; what would help: more GPUs ({more}), "
            "GPUs with more memory (--gpu-memory-gb), a shorter training.sequence_length or a smaller model"
        )
    if plan.rejected is not None:
        return f"no layout of {plan.gpus} GPUs passes validation; the first refusal: {plan.rejected}"
    return (
        f"no layout of {plan.gpus} GPUs keeps the global batch of {global_batch(config)} samples "
        "(dp must divide it, tp*cp*pp the rest): change --gpus or the batch (training.micro_batch_size, "
        "batch_accumulation_per_replica, parallelism.dp)"
    )
