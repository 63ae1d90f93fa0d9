"""The config schema: one dataclass per YAML section.

Field names are the public interface (DESIGN.md); users, tests and docs rely on them. Each field's
type hint drives parsing (see `loader.py`), and `metadata` carries the range checks, so a new field
is declared once, here, and is parsed, validated and documented from that single place. The
``model:`` section lives in ``schema_model.py``, ``slurm:`` in ``schema_slurm.py``, and the field
declarations (``bounded``, ``doc``, the shared limits) in ``fields.py``; every name is importable
from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from nanotrain.config.fields import (  # noqa: F401 (re-exported: the schema's public names)
    DATA_SOURCE,
    FLOAT32_TINY,
    HF_DIR,
    MAX_INT,
    MAX_LAYERS,
    MAX_WORLD,
    TOKENIZER,
    bounded,
    doc,
    slurm_time,
)
from nanotrain.config.schema_model import ModelArgs, MoEArgs, RopeScalingArgs  # noqa: F401
from nanotrain.config.schema_slurm import HealthArgs, PrepareArgs, SlurmArgs  # noqa: F401


@dataclass
class ParallelismArgs:
    dp: int = bounded(1, 1, MAX_WORLD, doc="data-parallel replicas")
    tp: int = bounded(1, 1, MAX_WORLD, doc="tensor-parallel shards of each layer")
    pp: int = bounded(1, 1, MAX_WORLD, doc="pipeline stages")
    cp: int = bounded(
        1, 1, MAX_WORLD, doc="context-parallel ranks: each holds 2 of 2*cp zig-zag chunks of every sequence"
    )
    cp_balance: Literal["zigzag", "documents"] = doc(
        "zigzag",
        "cp token order: zigzag (fixed, even for plain causal work) or documents (per micro-batch from the "
        "document ids: even under data.document_masking, which it needs)",
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
    max_consecutive_skips: int = bounded(
        8,
        1,
        100000,
        doc="skip, rewind: this many steps skipped in a row end the run as stop does (exit 3): the model "
        "or the data keeps failing and no step would ever apply",
    )


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
    zero_stage: Literal[0, 1, 2, 3] = doc(
        0,
        "1 shards optimizer states across dp; 2 also gradients (reduce-scattered every micro-batch, "
        "1/dp of the gradient memory for m reduce-scatters per step instead of one all-reduce); "
        "3 also parameters (each layer all-gathered before its forward and its backward, the next "
        "one prefetched, released after use: 1/dp of the weights, 2m gathers per step)",
    )
    grad_reduce_dtype: Literal["float32", "bfloat16"] = doc(
        "float32",
        "dtype the data-parallel gradient reduction sends and sums in (all-reduce, or ZeRO's "
        "reduce-scatters): float32 reduces the gradients as they are (fp32 master gradients); "
        "bfloat16 halves the bytes, the sums going back into the fp32 gradients (ZeRO-2/3: the "
        "fp32 accumulator)",
    )
    zero_shard_size: Optional[int] = bounded(
        None,
        2,
        doc="hybrid sharding: shard ZeRO state within blocks of this many consecutive dp ranks (e.g. one "
        "node's) and replicate it across the blocks, whose gradients are summed once per step; null: "
        "shard over all the replicas",
    )


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
class EvalJobArgs:
    """`checkpoints.eval_job`: the evaluation of each committed checkpoint as a job of its own."""

    enabled: bool = doc(
        False,
        "after each committed checkpoint rank 0 submits, without waiting, one SLURM job that evaluates "
        "it (eval.sources, eval.prompts) into the run's TensorBoard; --local: a process beside the ranks",
    )
    partition: Optional[str] = doc(None, "SLURM partition; default slurm.partition")
    cpus: int = bounded(2, 1, 65536, doc="CPU cores of the one task")
    gpus: int = bounded(0, 0, 64, doc="GPUs of the one task (0: it evaluates on the CPU)")
    time: int = slurm_time(30, doc="time limit: minutes, or a SLURM time (HH:MM:SS, D-HH:MM:SS)")
    mem_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="memory of the job", above=True)


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
    eval_job: EvalJobArgs = field(
        default_factory=EvalJobArgs,
        metadata={"doc": "an evaluation job per committed checkpoint (enabled, partition, cpus, gpus, time)"},
    )


@dataclass
class EvalSourceArgs:
    """One entry of `eval.sources`: a corpus whose loss every evaluation of a checkpoint reports."""

    name: str = doc("", "label of the source: TensorBoard eval/<name>/loss and eval/<name>/perplexity; unique")
    source: str = doc("", "files/dir/glob, a hub dataset name, or 'stdlib', as data.source", path=DATA_SOURCE)
    batches: int = bounded(
        1,
        1,
        1000000,
        doc="global batches (dp x micro-batches x micro_batch_size windows each, as training) read in order "
        "from the source's first window",
    )
    text_column: Optional[str] = doc(None, "column holding the text; default data.text_column")


@dataclass
class EvalArgs:
    """`eval`: what `--evaluate` and `checkpoints.eval_job` compute from a checkpoint."""

    sources: list[EvalSourceArgs] = doc(list, "corpora whose loss and perplexity each evaluation reports")
    prompts: list[str] = doc(list, "prompts continued greedily at each evaluation (TensorBoard text eval/samples)")
    sample_tokens: int = bounded(32, 1, 4096, doc="new tokens generated per prompt")


@dataclass
class LoggingArgs:
    dir: str = doc("logs", "parent of run directories", path="create dir")
    run_name: Optional[str] = doc(None, "run directory name; default <config name>-<timestamp>")
    log_interval: int = bounded(1, 1, doc="steps between metric lines")
    tensorboard: bool = doc(True, "write <run dir>/tb/ event files")


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
    eval: EvalArgs = field(default_factory=EvalArgs)
