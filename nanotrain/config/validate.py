"""Cross-field validation: everything that can be known wrong before a job is submitted.

Each check raises `ConfigError` with one line naming the field(s) and the fix. Per-field types and
ranges are checked by the loader; here live the rules that relate fields to each other, to the
world size, and to the sbatch script the job becomes (``validate_slurm.py``).
"""

from __future__ import annotations

from nanotrain.config.families import validate_family
from nanotrain.config.loader import ConfigError, check_fields
from nanotrain.config.schema import MAX_WORLD, Config
from nanotrain.config.validate_eval import validate_eval, validate_named_sources
from nanotrain.config.validate_slurm import SlurmLayout, parallel_product, slurm_layout, validate_names

# training.collective_timeout_s: the process groups get more on top (training.builder.hang_timeouts),
# which timedelta and torch's nanosecond clocks must still hold; a longer wait is no watchdog.
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0
MOE_FAMILIES = ("mixtral", "qwen3_moe")  # model.family values whose Hugging Face format has experts


def _fail(message: str):
    raise ConfigError(message)


def validate_layout(config: Config) -> None:
    """Rules that tie the model shape to the parallel layout alone (heads and widths over tp,
    layers over pp stages, experts over ep): what a layout must satisfy for the model to be cut
    into its ranks at all. Offline resharding checks its target with these (the batch and
    sequence rules belong to the run that later resumes the checkpoint, with its own settings)."""
    m, p = config.model, config.parallelism
    kv = m.num_key_value_heads or m.num_attention_heads
    if p.world_size > MAX_WORLD:
        _fail(
            f"parallelism: {parallel_product(config)} ranks; at most {MAX_WORLD:,} are supported: "
            "lower dp, tp, pp or cp"
        )
    # Without experts, ep ranks would silently train as data replicas.
    if p.ep > 1 and m.moe is None:
        _fail(
            f"parallelism.ep ({p.ep}): the model is dense (no model.moe, no experts to shard); "
            f"add a model.moe section or set parallelism.ep: 1 and give the ranks to dp (dp: {p.dp * p.ep})"
        )
    validate_family(config)
    if m.moe is not None:
        validate_moe(config)
    if m.rope_scaling is not None:
        validate_rope_scaling(config)
    validate_no_rope_layers(config)
    if m.dtype == "float16":
        _fail(
            "model.dtype: float16 needs loss scaling, which nanotrain does not do (its 5-bit exponent "
            "underflows small gradients); use bfloat16 (same memory and speed, fp32's range) or float32"
        )
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        _fail(
            f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_attention_heads "
            f"({m.num_attention_heads}): choose heads that divide the hidden size (or set model.head_dim)"
        )
    if m.head_dim is not None and m.head_dim % 2:
        _fail(f"model.head_dim ({m.head_dim}) must be even for RoPE (it rotates pairs of features)")
    if m.head_dim is None and (m.hidden_size // m.num_attention_heads) % 2:
        _fail(
            f"model: head dim hidden_size/num_attention_heads = {m.hidden_size // m.num_attention_heads} "
            "must be even for RoPE: change hidden_size or num_attention_heads"
        )
    if m.num_attention_heads % kv:
        _fail(
            f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({kv}) for grouped-query attention"
        )
    if m.num_attention_heads % p.tp:
        _fail(
            f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by parallelism.tp "
            f"({p.tp}): lower tp or change the head count"
        )
    if kv % p.tp:
        _fail(
            f"model.num_key_value_heads ({kv}) must be divisible by parallelism.tp ({p.tp}): "
            "lower tp or raise num_key_value_heads"
        )
    if m.intermediate_size % p.tp:
        _fail(f"model.intermediate_size ({m.intermediate_size}) must be divisible by parallelism.tp ({p.tp})")
    chunks = p.pp * p.pp_virtual_stages
    if m.num_layers < chunks:
        what = f"pp*pp_virtual_stages = {p.pp}*{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else f"pp ({p.pp})"
        _fail(
            f"model.num_layers ({m.num_layers}) must be at least parallelism.{what}: every pipeline stage needs a layer"
        )
    if p.pp_virtual_stages > 1 and p.pp_engine != "interleaved_1f1b":
        _fail(f"parallelism.pp_virtual_stages ({p.pp_virtual_stages}) needs pp_engine: interleaved_1f1b")


def validate_model(config: Config) -> None:
    """Rules that tie the model shape to the parallel layout (``validate_layout``) and the batch."""
    validate_layout(config)
    m, p, t = config.model, config.parallelism, config.training
    if t.sequence_length > m.max_position_embeddings:
        _fail(
            f"training.sequence_length ({t.sequence_length}) exceeds model.max_position_embeddings "
            f"({m.max_position_embeddings}): raise max_position_embeddings or shorten the sequence"
        )
    if m.sliding_window is not None and m.sliding_window < t.sequence_length:
        _fail(
            f"model.sliding_window ({m.sliding_window}) is shorter than training.sequence_length "
            f"({t.sequence_length}): nanotrain attends causally over the whole sequence; set it to "
            f"{t.sequence_length} or more (or null), or shorten training.sequence_length"
        )
    if p.cp > 1 and t.sequence_length % (2 * p.cp):
        _fail(
            f"training.sequence_length ({t.sequence_length}) must be divisible by 2*parallelism.cp "
            f"= {2 * p.cp} (each cp rank holds two of 2*cp equal chunks): change the length or cp"
        )
    if p.cp_balance == "documents" and not config.data.document_masking:
        _fail("parallelism.cp_balance 'documents' evens document-masked work: set data.document_masking: true")
    if m.attention_kernel == "flex" and not config.data.document_masking:
        _fail(
            "model.attention_kernel 'flex' runs document-masked attention: set data.document_masking: true "
            "(causal attention runs SDPA's own causal kernel) or model.attention_kernel: auto"
        )
    local_seq = t.sequence_length // p.cp
    if p.tp_mode == "REDUCE_SCATTER" and local_seq % p.tp:
        what = (
            f"training.sequence_length/parallelism.cp = {t.sequence_length}/{p.cp}"
            if p.cp > 1
            else f"training.sequence_length ({t.sequence_length})"
        )
        _fail(f"{what} must be divisible by parallelism.tp ({p.tp}) under tp_mode REDUCE_SCATTER (sequence shards)")
    m_micro = t.batch_accumulation_per_replica
    if p.pp > 1 and p.pp_engine == "1f1b" and m_micro < p.pp:
        _fail(
            f"training.batch_accumulation_per_replica ({m_micro}) must be >= parallelism.pp ({p.pp}) "
            "for pp_engine 1f1b: raise it, or use pp_engine: afab"
        )
    if p.pp_engine == "interleaved_1f1b" and m_micro % p.pp:
        _fail(
            f"training.batch_accumulation_per_replica ({m_micro}) must be a multiple of parallelism.pp "
            f"({p.pp}) for pp_engine interleaved_1f1b"
        )


def validate_moe(config: Config) -> None:
    """``model.moe`` against the model and ``parallelism.ep``."""
    moe, m, p = config.model.moe, config.model, config.parallelism
    if moe.top_k > moe.num_experts:
        _fail(f"model.moe.top_k ({moe.top_k}) must not exceed model.moe.num_experts ({moe.num_experts})")
    if moe.num_experts % p.ep:
        _fail(
            f"model.moe.num_experts ({moe.num_experts}) must be divisible by parallelism.ep ({p.ep}): "
            "every ep rank holds num_experts / ep experts"
        )
    if moe.first_dense_layers >= m.num_layers:
        _fail(
            f"model.moe.first_dense_layers ({moe.first_dense_layers}) leaves no MoE layer among "
            f"model.num_layers ({m.num_layers}): lower it, or drop model.moe"
        )
    ffn = moe.expert_intermediate_size or m.intermediate_size
    if (moe.num_shared_experts * ffn) % p.tp:
        _fail(
            f"model.moe.num_shared_experts * expert width ({moe.num_shared_experts * ffn}) must be divisible "
            f"by parallelism.tp ({p.tp}): the shared experts are split over tp"
        )
    family = config.model.family
    if config.checkpoints.init_from_hf and family not in MOE_FAMILIES:
        _fail(
            f"checkpoints.init_from_hf: a Hugging Face {family} checkpoint has no experts to initialise model.moe "
            f"from: set model.family to {' or '.join(MOE_FAMILIES)} for such a directory "
            "(python scripts/hf_config.py DIR prints the section), or drop model.moe"
        )


def validate_no_rope_layers(config: Config) -> None:
    """``model.no_rope_layers``: decoder layer indices, each once."""
    m, seen = config.model, set()
    for i, layer in enumerate(m.no_rope_layers):
        if not 0 <= layer < m.num_layers:
            _fail(
                f"model.no_rope_layers[{i}]: {layer} is not a decoder layer index (0 .. {m.num_layers - 1} "
                f"for model.num_layers {m.num_layers}): remove it or fix the index"
            )
        if layer in seen:
            _fail(f"model.no_rope_layers[{i}]: layer {layer} is listed twice; list each layer once")
        seen.add(layer)


def validate_rope_scaling(config: Config) -> None:
    """``model.rope_scaling`` against itself and the model's context (its own ranges are the loader's)."""
    rs, m = config.model.rope_scaling, config.model
    if rs.low_freq_factor >= rs.high_freq_factor:
        _fail(
            f"model.rope_scaling.low_freq_factor ({rs.low_freq_factor}) must be below high_freq_factor "
            f"({rs.high_freq_factor}): the smoothed band lies between them (Llama 3.1: 1.0 and 4.0)"
        )
    if rs.original_max_position_embeddings >= m.max_position_embeddings:
        _fail(
            f"model.rope_scaling.original_max_position_embeddings ({rs.original_max_position_embeddings}) must be "
            f"below model.max_position_embeddings ({m.max_position_embeddings}): scaling stretches the original "
            "context to max_position_embeddings; raise max_position_embeddings (Llama 3.1: 131072) or drop "
            "model.rope_scaling"
        )


def validate_optimizer(config: Config) -> None:
    o = config.optimizer
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            _fail(f"optimizer.betas[{i}]: {beta} must be in [0, 1)")
    if o.min_lr > o.lr:
        _fail(f"optimizer.min_lr ({o.min_lr}) must not exceed optimizer.lr ({o.lr})")
    # AdamW multiplies the decayed weights by 1 - lr * weight_decay every step.
    if o.lr * o.weight_decay >= 1.0:
        _fail(
            f"optimizer.weight_decay ({o.weight_decay:g}) x optimizer.lr ({o.lr:g}) = {o.lr * o.weight_decay:g} "
            "must be below 1: AdamW multiplies the weights by 1 - lr*weight_decay each step, which would zero "
            "or flip them; the usual weight_decay is 0.1"
        )
    if o.zero_shard_size is not None:
        validate_zero_shard_size(config)
    if o.lr_decay_style == "wsd":
        steps = config.training.train_steps
        decay = wsd_decay_steps(o.decay_fraction, steps)
        if o.warmup_steps + decay > steps:
            _fail(
                f"optimizer.warmup_steps ({o.warmup_steps}) + the wsd decay (optimizer.decay_fraction="
                f"{o.decay_fraction} of {steps} steps = {decay}) exceed training.train_steps ({steps}): "
                "lower warmup_steps or decay_fraction"
            )


def validate_zero_shard_size(config: Config) -> None:
    """Hybrid sharding: blocks of ``zero_shard_size`` replicas (``data_parallel/hybrid.py``)."""
    o, p = config.optimizer, config.parallelism
    s = o.zero_shard_size
    if o.zero_stage == 0:
        _fail(f"optimizer.zero_shard_size ({s}) shards ZeRO state: set optimizer.zero_stage 1, 2 or 3, or drop it")
    replicas = {"dp x cp x ep (the dense replicas)": p.dp * p.cp * p.ep}
    if p.ep > 1:
        replicas["dp x cp (an expert shard's replicas)"] = p.dp * p.cp
    for what, n in replicas.items():
        if n % s:
            _fail(f"optimizer.zero_shard_size ({s}) must divide {what} = {n}: pick a divisor, or drop it")


def wsd_decay_steps(decay_fraction: float, train_steps: int) -> int:
    """The steps a wsd schedule decays over: `decay_fraction * train_steps`, rounded, at least 1."""
    return max(1, round(decay_fraction * train_steps))


def validate_data(config: Config) -> None:
    """The mixture, the validation split and evaluation: the rules between their fields."""
    d, t = config.data, config.training
    validate_named_sources(d.sources, "data.sources", "source", "data/tokens/<name>", "web")
    if d.sources and d.source != "stdlib":
        _fail(
            f"data.source ({d.source!r}) and data.sources are both set: list every corpus in data.sources "
            "(data.source is the one-source shorthand)"
        )
    v = d.validation
    if v is not None:
        if (v.source is None) == (v.fraction is None):
            _fail(
                "data.validation: set exactly one of source (a corpus of its own) or fraction "
                "(a share held out of each training source), e.g. {fraction: 0.01}"
            )
        if v.fraction is not None and v.fraction >= 1.0:
            _fail(
                f"data.validation.fraction: {v.fraction} must be below 1 (it is the share held out of "
                "training), e.g. 0.01"
            )
    if t.eval_interval > 0:
        if v is None:
            _fail(
                f"training.eval_interval ({t.eval_interval}) needs data.validation: add "
                "data.validation: {fraction: 0.01} or {source: PATH}, or set eval_interval: 0"
            )
        if t.eval_batches < 1:
            _fail(
                f"training.eval_batches is 0 with training.eval_interval {t.eval_interval}: "
                "set eval_batches >= 1, or eval_interval: 0 to turn evaluation off"
            )


PROFILE_KEYS = ("start_step", "num_steps")


def validate_profile(config: Config) -> None:
    """`training.profile`: exactly {start_step >= 1, num_steps >= 1}, inside the run."""
    prof = config.training.profile
    if prof is None:
        return
    for key in prof:
        if key not in PROFILE_KEYS:
            _fail(f"training.profile.{key}: unknown key; use training.profile: {{start_step: S, num_steps: N}}")
    for key in PROFILE_KEYS:
        if key not in prof:
            _fail(f"training.profile.{key}: missing; use training.profile: {{start_step: S, num_steps: N}}")
        if prof[key] < 1:
            _fail(f"training.profile.{key}: {prof[key]} must be >= 1 (steps count from 1)")
    if prof["start_step"] > config.training.train_steps:
        _fail(
            f"training.profile.start_step: {prof['start_step']} is after the last step "
            f"(training.train_steps = {config.training.train_steps}); profile an earlier step"
        )


def validate(config: Config, *, slurm: bool = False) -> SlurmLayout | None:
    """All pre-submission checks of a parsed config; touches no file and no device.

    Args:
        config: the config to check (loaded or built in code: the per-field checks run again).
        slurm: also derive the SLURM job's shape (nodes x tasks per node, signal timing).

    Returns:
        The ``SlurmLayout`` when ``slurm`` is true, else None.

    Raises:
        ConfigError: the first rule broken (the parallel layout against the model, the model,
            MoE, optimizer, data, profile and name rules; with ``slurm``, the node layout), as one
            line naming the field(s) and the fix.
    """
    check_fields(config)
    if config.training.collective_timeout_s > MAX_COLLECTIVE_TIMEOUT_S:
        _fail(
            f"training.collective_timeout_s: {config.training.collective_timeout_s:g} s is more than 7 days "
            f"({MAX_COLLECTIVE_TIMEOUT_S:g} s), longer than a hang should go unnoticed: lower it"
        )
    if config.training.spike.policy == "rewind" and not config.checkpoints.interval:
        _fail(
            "training.spike.policy: rewind goes back to the last checkpoint, but checkpoints.interval is 0 "
            "(none before a preemption or the end): set checkpoints.interval (e.g. 500), or use policy skip"
        )
    validate_profile(config)
    validate_model(config)
    validate_optimizer(config)
    validate_data(config)
    validate_eval(config)
    validate_names(config)
    return slurm_layout(config) if slurm else None
