"""The config schema: one dataclass per YAML section.

Field names are the public interface (DESIGN.md); users, tests and docs rely on them. Each field's
type hint drives parsing (see `loader.py`), and `metadata` carries the range checks, so a new field
is declared once, here, and is parsed, validated and documented from that single place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

# Integers without their own maximum stop here: beyond 2**53 floats (the memory estimate, the
# plan) are no longer exact, and a YAML integer of any size would otherwise be taken.
MAX_INT = 2**53
# The most ranks one job may have (the largest clusters have ~10^5 accelerators); keeps every
# plan and rank-grid listing of --dry-run within a fraction of a second.
MAX_WORLD = 2**20
# The deepest model accepted. Trained decoders have ~100-200 layers (research ones up to ~500):
# 1024 is beyond them all, and keeps what is computed per layer (the exact pipeline stage split,
# about layers**2 / stages of work per layout, for --dry-run and each layout --plan tries) within
# a fraction of a second; a typo (9007199254740991) is refused instead of computed.
MAX_LAYERS = 1024
# Path kinds of `doc(path=...)` beyond those of config/paths.py, each checked by the layer that
# knows it: a data source is a file, a directory or a glob unless it is 'stdlib' or a hub name,
# a tokenizer a file unless 'byte' (data); a Hugging Face directory is read only on a first start
# (hf.directory, from commands.preflight), so a resumed run does not need it any more.
DATA_SOURCE, TOKENIZER, HF_DIR = "data source", "tokenizer", "hf dir"
# The smallest normal float32: a smaller epsilon added to a float32 tensor is lost (0 or a
# denormal), so it no longer keeps a division by a zero second moment away from 0/0.
FLOAT32_TINY = 2.0**-126


def bounded(default, lo=None, hi=None, doc: str = "", above: bool = False, parse: str | None = None, why: str = ""):
    """A field with an inclusive numeric range (`above`: the minimum itself is excluded), checked
    by the loader with the field's name. Floats must also be finite (the loader refuses NaN/inf).
    `parse` names a loader hook that reads the value instead of its type hint. `why` is added to
    the error of a value out of range: what the value would do in the ranks, and the fix."""
    return field(
        default=default, metadata={"min": lo, "max": hi, "min_exclusive": above, "doc": doc, "parse": parse, "why": why}
    )


def slurm_time(default: int, doc: str):
    """Integer minutes that may also be given as a SLURM time string ("1:30:00", "1-00:00:00");
    at least a minute, at most a year."""
    return bounded(default, 1, 525600, doc=doc, parse="slurm_time")


def doc(default, text: str, path: str | None = None, why: str = ""):
    """A plain field with a one-line description; `list`/`dict` defaults become factories.
    `path` marks a path-typed field with what it must be (a kind of `paths.py`, or DATA_SOURCE /
    TOKENIZER, whose keywords and hub names are not paths): every such field gets the path
    checker, and a test enumerates them from here. `why` follows the loader's error for a value
    that is not one of a `Literal`'s choices: the fix."""
    meta = {"doc": text} if path is None else {"doc": text, "path": path}
    if why:
        meta["why"] = why
    if default in (list, dict):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ParallelismArgs:
    dp: int = bounded(1, 1, MAX_WORLD, doc="data-parallel replicas")
    tp: int = bounded(1, 1, MAX_WORLD, doc="tensor-parallel shards of each layer")
    pp: int = bounded(1, 1, MAX_WORLD, doc="pipeline stages")
    cp: int = bounded(
        1, 1, MAX_WORLD, doc="context-parallel ranks: each holds 2 of 2*cp zig-zag chunks of every sequence"
    )
    ep: int = bounded(1, 1, MAX_WORLD, doc="expert-parallel ranks: each holds model.moe.num_experts / ep experts")
    pp_engine: Literal["afab", "1f1b", "interleaved_1f1b"] = doc("1f1b", "pipeline schedule")
    pp_virtual_stages: int = bounded(1, 1, 1024, doc="model chunks per pp rank (interleaved_1f1b)")
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = doc("ALL_REDUCE", "REDUCE_SCATTER = sequence parallelism")
    tp_linear_async_communication: bool = doc(False, "overlap TP collectives with matmuls")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def batch_replicas(self) -> int:
        """Ranks that read different samples: dp x ep (ep ranks are data replicas of the dense
        layers; only the experts are split among them)."""
        return self.dp * self.ep


@dataclass
class MoEArgs:
    """``model.moe``: which decoder layers replace their SwiGLU MLP by routed SwiGLU experts.

    Router: softmax over all experts, top-k, weights renormalised over the k (``norm_topk_prob``). Layer i is
    MoE when ``i >= first_dense_layers`` and ``(i - first_dense_layers) % layer_frequency == 0``."""

    num_experts: int = bounded(8, 1, 65536, doc="routed experts per MoE layer")
    top_k: int = bounded(2, 1, 65536, doc="experts each token is sent to (<= num_experts)")
    expert_intermediate_size: Optional[int] = bounded(
        None, 1, doc="SwiGLU width of one expert; null = model.intermediate_size"
    )
    num_shared_experts: int = bounded(
        0, 0, 1024, doc="0 = Mixtral; >= 1 = DeepSeek/Qwen: an always-on SwiGLU of this many experts' width"
    )
    layer_frequency: int = bounded(1, 1, doc="every k-th layer (after first_dense_layers) is MoE")
    first_dense_layers: int = bounded(0, 0, doc="leading decoder layers that stay dense")
    aux_loss_coef: float = bounded(0.01, 0.0, 1e3, doc="Switch/Mixtral load-balancing loss weight")
    z_loss_coef: float = bounded(0.0, 0.0, 1e3, doc="router z-loss weight (ST-MoE)")
    capacity_factor: Optional[float] = bounded(
        None,
        0.0,
        1e3,
        doc="null = dropless; else tokens per expert capped at ceil(factor * tokens * top_k / num_experts)",
        above=True,
    )
    norm_topk_prob: bool = doc(
        True,
        "renormalise the top_k router weights to sum to 1 (Mixtral, Qwen3-MoE's usual setting); "
        "false keeps the softmax probabilities (Qwen3-MoE's transformers default)",
    )


@dataclass
class RopeScalingArgs:
    """``model.rope_scaling``: RoPE frequencies stretched for a longer context than pretraining's
    (absent = plain RoPE). ``llama3`` (Llama 3.1-3.3): with wavelength ``2*pi / inv_freq``,
    frequencies whose wavelength is below ``original_max_position_embeddings / high_freq_factor``
    are kept, those above ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, and the band between is interpolated smoothly (Hugging Face's ``rope_type: llama3``)."""

    type: Literal["llama3"] = doc(
        "llama3",
        "scaling scheme; llama3 (Llama 3.1/3.2/3.3) is the one supported",
        why="llama3 is the one scaling nanotrain computes; for plain RoPE remove model.rope_scaling (or set null)",
    )
    factor: float = bounded(
        8.0,
        1.0,
        doc="low frequencies are divided by this (Llama 3.1: 8, Llama 3.2: 32)",
        why="a factor below 1 would shorten the context, not stretch it; Llama 3.1 uses 8.0",
    )
    low_freq_factor: float = bounded(
        1.0, 0.0, doc="wavelengths above original_max_position_embeddings / this are scaled", above=True
    )
    high_freq_factor: float = bounded(
        4.0,
        0.0,
        doc="wavelengths below original_max_position_embeddings / this are kept (> low_freq_factor)",
        above=True,
    )
    original_max_position_embeddings: int = bounded(
        8192, 1, doc="pretraining context the frequencies were trained at (< model.max_position_embeddings)"
    )


@dataclass
class ModelArgs:
    vocab_size: int = bounded(256, 1, doc="tokens; padded to a multiple of tp inside the model")
    hidden_size: int = bounded(128, 1, doc="model width")
    intermediate_size: int = bounded(512, 1, doc="SwiGLU MLP width")
    num_layers: int = bounded(4, 1, MAX_LAYERS, doc="decoder layers")
    num_attention_heads: int = bounded(4, 1, doc="query heads")
    num_key_value_heads: Optional[int] = bounded(None, 1, doc="defaults to num_attention_heads")
    max_position_embeddings: int = bounded(2048, 1, doc="longest sequence RoPE is built for")
    rope_theta: float = bounded(10000.0, 0.0, 1e12, doc="RoPE base", above=True)
    rms_norm_eps: float = bounded(1e-5, 0.0, 1.0, doc="RMSNorm epsilon")
    tie_word_embeddings: bool = doc(False, "LM head shares the embedding matrix")
    dtype: Literal["float32", "bfloat16", "float16"] = doc(
        "bfloat16",
        "compute dtype (autocast, on GPU and CPU); weights, grads and optimizer stay "
        "float32; float16 is refused (no loss scaler)",
    )
    init_std: float = bounded(
        0.02,
        0.0,
        1.0,
        above=True,
        doc="std of the normal init of weights",
        why="all-zero weights get zero gradients, so the model would never learn; the usual value is 0.02",
    )
    moe: Optional[MoEArgs] = doc(None, "mixture of experts (absent = dense): the model.moe fields")
    rope_scaling: Optional[RopeScalingArgs] = doc(
        None, "RoPE scaling for long context (absent = plain RoPE): the model.rope_scaling fields"
    )
    family: Literal["llama", "mistral", "qwen2", "qwen3", "smollm3", "mixtral", "qwen3_moe"] = doc(
        "llama",
        "Hugging Face family (its model_type): the names and config.json that init_from_hf reads and "
        "export writes; the options below say what the model computes",
        why="nanotrain imports and exports these Hugging Face families; "
        "python scripts/hf_config.py DIR prints the section of a directory",
    )
    head_dim: Optional[int] = bounded(
        None, 1, doc="features per attention head; null = hidden_size / num_attention_heads (Qwen3: 128)"
    )
    qkv_bias: bool = doc(False, "bias terms on the q, k and v projections (Qwen2 / Qwen2.5)")
    qk_norm: bool = doc(False, "RMSNorm over each head's features of q and k, before RoPE (Qwen3, Qwen3-MoE)")
    no_rope_layers: list[int] = doc(list, "indices of the decoder layers that apply no RoPE (SmolLM3)")
    sliding_window: Optional[int] = bounded(
        None,
        1,
        doc="attention window in tokens (Mistral); null = full causal attention; at least "
        "training.sequence_length (where it changes nothing), a shorter window is refused",
    )


@dataclass
class SpikeArgs:
    """training.spike: what a step whose loss or gradient norm spikes or is not finite does (README)."""

    policy: Literal["stop", "skip", "rewind"] = doc(
        "stop",
        "stop: a non-finite step ends the run (exit 3); skip: a spiking or non-finite step applies no update; "
        "rewind: that, then back to the last checkpoint, leaving out the data read since",
    )
    factor: float = bounded(6.0, 1.0, 1e6, above=True, doc="loss or grad norm above factor x its median = spike")
    window: int = bounded(32, 1, 4096, doc="skip, rewind: medians of the last `window` applied steps (once full)")
    max_rewinds: int = bounded(3, 0, 1000, doc="rewind: rewinds per run; one spike more ends it as stop does (exit 3)")


@dataclass
class TrainingArgs:
    train_steps: int = bounded(100, 1, doc="optimizer steps")
    sequence_length: int = bounded(256, 1, doc="tokens per sample")
    micro_batch_size: int = bounded(1, 1, doc="samples per micro-batch per dp rank")
    batch_accumulation_per_replica: int = bounded(1, 1, doc="micro-batches per step = pipeline m")
    seed: int = bounded(42, 0, 2**63 - 1, doc="init, data order and dropout-free RNG")
    eval_interval: int = bounded(0, 0, doc="validate every N steps and at the last step; 0 = off")
    eval_batches: int = bounded(1, 0, doc="global batches of data.validation per evaluation")
    collective_timeout_s: float = bounded(
        600.0,
        1.0,
        doc="timeout of every process group and of the hang watchdog: a rank whose step does "
        "not advance this long ends the job (exit 4) with reports in <run>/hang/",
    )
    profile: Optional[dict[str, int]] = doc(
        None, "{start_step, num_steps}: torch.profiler traces of those steps in <run>/profile/; null = off"
    )
    recompute: Literal["none", "selective", "full"] = doc(
        "none", "activation recomputation: selective (attention core + SwiGLU activation), full (each decoder layer)"
    )
    compile: bool = doc(False, "torch.compile each decoder layer (GPU, or CPU with a C++ compiler)")
    loss_chunk_tokens: Optional[int] = bounded(
        None,
        0,
        doc="final norm, LM head and loss this many tokens at a time, each chunk's logits recomputed in "
        "backward; null = 2048 at a vocabulary of 32000 or more where that lowers the head's peak "
        "memory (--dry-run says), else off; 0 = off",
        why="0 turns the chunked loss off, N > 0 computes the logits N tokens at a time, null lets "
        "--dry-run's estimate choose",
    )
    spike: SpikeArgs = field(default_factory=SpikeArgs, metadata={"doc": "loss spikes and non-finite steps"})


@dataclass
class OptimizerArgs:
    lr: float = bounded(
        3e-4,
        0.0,
        10.0,
        doc="peak learning rate (a larger one is a typo: 3e4 for 3e-4; 0 "
        "trains nothing: an evaluation-only or round-trip run)",
    )
    weight_decay: float = bounded(0.1, 0.0, doc="AdamW decay of matrices (not norms); lr * weight_decay < 1")
    betas: tuple[float, float] = doc((0.9, 0.95), "AdamW (beta1, beta2), each in [0, 1)")
    eps: float = bounded(
        1e-8,
        FLOAT32_TINY,
        1.0,
        doc="AdamW epsilon",
        why="AdamW divides by sqrt(second moment) + eps, and a parameter whose gradient is "
        "zero (an embedding row no token used) would become 0/0 = NaN; the usual value is 1e-8",
    )
    clip_grad: Optional[float] = bounded(
        1.0,
        0.0,
        above=True,
        doc="global grad-norm clip; null disables",
        why="set null to disable clipping, or a positive norm such as 1.0",
    )
    warmup_steps: int = bounded(0, 0, doc="linear warm-up steps (more than train_steps: lr rises all run)")
    lr_decay_style: Literal["cosine", "linear", "constant", "wsd"] = doc(
        "cosine", "decay to min_lr at train_steps; wsd = warmup, stable at lr, decay in the last decay_fraction"
    )
    decay_fraction: float = bounded(
        0.2, 0.0, 1.0, above=True, doc="wsd: share of train_steps spent decaying (the last ones)"
    )
    decay_shape: Literal["linear", "1-sqrt"] = doc("1-sqrt", "wsd: shape of the decay to min_lr")
    min_lr: float = bounded(0.0, 0.0, doc="final learning rate")
    zero_stage: Literal[0, 1] = doc(0, "1 shards optimizer states across dp")


@dataclass
class SourceArgs:
    """One entry of `data.sources`: a corpus and its share of the training samples."""

    name: str = doc("", "label of the source in logs and TensorBoard (data/tokens/<name>); unique")
    source: str = doc("", "files/dir/glob, a hub dataset name, or 'stdlib', as data.source", path=DATA_SOURCE)
    weight: float = bounded(1.0, 0.0, above=True, doc="relative share of training samples (normalised)")
    text_column: Optional[str] = doc(None, "column holding the text; default data.text_column")


@dataclass
class ValidationArgs:
    """`data.validation`: a held-out set, either a source of its own or a tail of each source."""

    source: Optional[str] = doc(None, "files/dir/glob or hub name of a validation corpus", path=DATA_SOURCE)
    fraction: Optional[float] = bounded(
        None, 0.0, 1.0, above=True, doc="share of each training source's windows held out (< 1)"
    )


@dataclass
class DataArgs:
    source: str = doc(
        "stdlib", "files/dir/glob, a hub dataset name, or 'stdlib' (Python's own sources)", path=DATA_SOURCE
    )
    text_column: str = doc("text", "column holding the text")
    tokenizer: str = doc("byte", "'byte' or a path to a tokenizer.json", path=TOKENIZER)
    num_workers: int = bounded(0, 0, 1024, doc="tokenisation processes")
    sources: list[SourceArgs] = doc(list, "weighted mixture; when set, data.source is not used")
    validation: Optional[ValidationArgs] = doc(None, "held-out set for training.eval_interval")
    max_build_mb: Optional[float] = bounded(
        512.0,
        0.0,
        doc="a training job tokenises a source without a cache only up to this size on disk "
        "(larger: run --prepare-data first); null = no limit",
    )
    cache_dir: Optional[str] = doc(
        None,
        "where tokenised sources are cached; default <logging.dir>/.cache/data (a sweep's points: "
        "that of the sweep's logging.dir)",
        path="create dir",
    )
    document_masking: bool = doc(
        False,
        "attention stays within each packed document (a document: its tokens up to and including "
        "the separator) and RoPE positions restart at 0 at each one, and at each window's start",
    )
    mask_boundary_loss: bool = doc(
        False,
        "ignore the loss of each separator token, whose target is the next document's first token "
        "(false: it is trained)",
    )


@dataclass
class CheckpointArgs:
    path: Optional[str] = doc(None, "default <run dir>/checkpoints", path="create dir")
    interval: int = bounded(0, 0, doc="save every N steps; 0 = only on demand / preemption")
    keep_last: int = bounded(2, 1, doc="complete checkpoints kept")
    resume: bool = doc(True, "continue from the latest complete checkpoint in the run dir")
    save_on_preemption: bool = doc(True, "save when SLURM signals a preemption or time limit")
    allow_foreign: bool = doc(False, "resume from a checkpoint another run wrote (else refused)")
    async_save: bool = doc(
        False,
        "copy the state to host memory beside the next step (its update waits for "
        "the copy) and write it from a background thread while training goes on "
        "(committed at a later step)",
    )
    init_from_hf: Optional[str] = doc(
        None,
        "local Hugging Face Llama directory the weights start from when the "
        "run has no checkpoint yet (optimizer and step start fresh)",
        path=HF_DIR,
    )


@dataclass
class LoggingArgs:
    dir: str = doc("logs", "parent of run directories", path="create dir")
    run_name: Optional[str] = doc(None, "run directory name; default <config name>-<timestamp>")
    log_interval: int = bounded(1, 1, doc="steps between metric lines")
    tensorboard: bool = doc(True, "write <run dir>/tb/ event files")


@dataclass
class PrepareArgs:
    """`slurm.prepare`: the CPU-only job of `submit.py CONFIG --prepare-data`."""

    partition: Optional[str] = doc(None, "SLURM partition; default slurm.partition")
    cpus: int = bounded(4, 1, 65536, doc="CPU cores of the one task (data.num_workers uses them)")
    time: int = slurm_time(60, doc="time limit: minutes, or a SLURM time (HH:MM:SS, D-HH:MM:SS)")
    mem_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="memory of the job", above=True)


@dataclass
class SlurmArgs:
    gpus_per_node: int = bounded(0, 0, 1024, doc="0 = CPU-only cluster (then tasks_per_node)")
    tasks_per_node: Optional[int] = bounded(None, 1, 65536, doc="CPU clusters; GPU: = gpus_per_node")
    cpus_per_task: int = bounded(1, 1, 65536, doc="also OMP_NUM_THREADS of each task")
    mem_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="memory per node", above=True)
    gpu_memory_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="for the --dry-run memory estimate", above=True)
    time: int = slurm_time(60, doc="time limit: minutes (at most a year), or a SLURM time (HH:MM:SS, D-HH:MM:SS)")
    partition: Optional[str] = doc(None, "SLURM partition")
    account: Optional[str] = doc(None, "SLURM account")
    qos: Optional[str] = doc(None, "SLURM quality of service")
    constraint: Optional[str] = doc(None, "node features, e.g. h100")
    exclusive: bool = doc(False, "whole nodes")
    max_requeues: int = bounded(3, 0, doc="requeues after preemption / time limit")
    array_parallelism: int = bounded(
        0, 0, 100000, doc="--sweep: at most this many points of the job array run at once; 0 = all"
    )
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = doc(
        "USR2", "sent by SLURM before the time limit / on preemption"
    )
    signal_delay_s: int = bounded(120, 0, 65535, doc="seconds before the limit that the signal comes")
    setup: list[str] = doc(list, "trusted shell lines run before srun (module load, source venv)")
    sbatch_extra: dict[str, str] = doc(dict, "extra #SBATCH options, e.g. {mail-type: END}")
    env: dict[str, str] = doc(dict, "exported before init (NCCL_*, InfiniBand settings)")
    prepare: PrepareArgs = field(
        default_factory=PrepareArgs, metadata={"doc": "the CPU job of --prepare-data (partition, cpus, time)"}
    )


@dataclass
class Config:
    parallelism: ParallelismArgs = field(default_factory=ParallelismArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    data: DataArgs = field(default_factory=DataArgs)
    checkpoints: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    slurm: SlurmArgs = field(default_factory=SlurmArgs)
