"""The config's validation rules: every rule a user can break in a config file but a model
family's own (its module in jaxptd/arch/ declares those, and the options only it reads;
`validate` asks the registry).

Single keys (CHOICES, POSITIVE, NON_NEGATIVE, the open intervals), then the cross-field
rules of the model, the parallel layout, training and the runtime. Every failure is a
`ConfigError` whose message is one line naming the key, the value and the rule. The
device-count rule (data x pipe x context x tensor == devices) is checked here against
``runtime.cpu_devices`` when it is set, and by the caller (`check_device_count`) against
the real device count. JAX-free.
"""
from __future__ import annotations

from typing import Any

from jaxptd.arch import FAMILIES
from jaxptd.config.schema import Config, ConfigError, ModelConfig, ParallelConfig
from jaxptd.pipeline.schedules import ScheduleError, make_schedule
from jaxptd.runtime.target import NAMES as TARGET_NAMES

CHOICES = {
    "model.arch": tuple(FAMILIES),
    "optimizer.name": ("adamw", "sgd"),
    "optimizer.grad_reduce_dtype": ("float32", "bfloat16"),
    "optimizer.overlap_grad_reduce": ("auto", "true", "false"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.kernels": ("xla", "pallas"),
    "model.attention": ("xla", "cudnn", "flash"),
    "model.fp8": ("none", "tensorwise", "delayed"),
    "model.remat": ("none", "minimal", "minimal_mlp", "selective", "full"),
    "model.scan_layers": ("auto", "true", "false"),
    "parallel.fsdp_unit": ("layer", "matmul"),
    "model.gelu": ("tanh", "erf"),
    "model.norm_position": ("pre", "post"),
    "model.rope_scaling": ("none", "llama3"),
    "model.moe_router": ("softmax", "sigmoid"),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-interleaved", "zb-v"),
    "parallel.stash": ("activations", "inputs"),
    "parallel.round_form": ("auto", "cond", "steady", "masked"),
    "parallel.context_attention": ("ring", "allgather"),
    "optimizer.loss_scale": ("none", "dynamic"),
    "runtime.target": TARGET_NAMES,
}
POSITIVE = (
    "model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_len",
    "model.vocab_size", "model.rope_factor", "model.rope_low_freq_factor",
    "model.rope_high_freq_factor", "model.rope_original_seq_len", "parallel.data",
    "parallel.pipe", "parallel.tensor",
    "parallel.context", "parallel.expert", "parallel.microbatches", "parallel.chunks",
    "model.moe_every", "model.fp8_history", "train.steps",
    "train.global_batch",
    "train.log_every", "train.eval_batches", "checkpoint.keep", "checkpoint.local_keep",
    "runtime.init_timeout_s",
    "runtime.heartbeat_timeout_s", "runtime.watchdog_min_s", "runtime.watchdog_first_s",
    "runtime.straggler_window",
)
NON_NEGATIVE = (
    "optimizer.warmup_steps", "optimizer.decay_steps", "train.eval_every",
    "checkpoint.every", "checkpoint.local_every", "optimizer.weight_decay",
    "optimizer.clip_norm", "optimizer.lr", "optimizer.min_lr", "model.init_std",
    "runtime.cpu_devices", "model.ffn_size",
    "model.num_kv_heads", "parallel.fsdp_group", "model.moe_experts", "model.moe_ffn",
    "model.moe_shared_ffn", "model.moe_capacity", "model.moe_aux_loss", "model.moe_z_loss",
    "model.moe_bias_rate", "model.fp8_margin",
    "runtime.num_processes",
)


def _get(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Checks every cross-field rule; raises ConfigError naming key, value and rule."""
    _validate_ranges(config)
    _validate_options(config.model)
    _validate_model(config.model, config.parallel)
    _validate_moe(config)
    for message in FAMILIES[config.model.arch].config_errors(config.model):
        raise ConfigError(message)
    _validate_parallel(config)
    _validate_training(config)
    _validate_data(config)
    _validate_checkpoint(config)
    _validate_runtime(config)


def _validate_ranges(config: Config) -> None:
    """One key at a time: CHOICES, POSITIVE, NON_NEGATIVE and the open intervals."""
    for key, choices in CHOICES.items():
        value = _get(config, key)
        _require(value in choices, f"{key}={value!r}: must be one of {', '.join(choices)}")
    for key in POSITIVE:
        _require(_get(config, key) > 0, f"{key}={_get(config, key)}: must be positive")
    for key in NON_NEGATIVE:
        _require(_get(config, key) >= 0, f"{key}={_get(config, key)}: must be >= 0")
    m = config.model
    _require(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout}: must be in [0, 1)")
    _require(0.0 <= config.optimizer.momentum < 1.0,
             f"optimizer.momentum={config.optimizer.momentum}: must be in [0, 1)")
    _require(m.rope_theta > 0, f"model.rope_theta={m.rope_theta}: must be positive")


def _validate_options(m: ModelConfig) -> None:
    """A model key only some families read (Family.options) stays at its default in the
    others' configs."""
    own, default = FAMILIES[m.arch].options, ModelConfig()
    for family in FAMILIES.values():
        for key, message in family.options.items():
            value = getattr(m, key)
            _require(key in own or value == getattr(default, key), message.format(value=value))


def _validate_model(m: ModelConfig, par: ParallelConfig) -> None:
    """Attention's kernels and the shapes tensor parallelism splits. Grouped-query
    attention: key/value heads split over tensor ranks when t divides them, else
    replicated, which needs t to be a multiple of them (each rank's query heads then share
    one key/value head)."""
    tensor = par.tensor
    _require(not (m.attention in ("cudnn", "flash") and m.dropout > 0),
             f"model.dropout={m.dropout}: model.attention={m.attention} has no attention "
             "dropout; set model.dropout=0 or model.attention=xla")
    _require(m.attention != "flash" or m.hidden_size // m.num_heads <= 256,
             f"model.attention=flash: head width {m.hidden_size // m.num_heads} (hidden_size"
             " / num_heads) must be at most 256 (Pallas flash attention's tiles)")
    _require(not (m.attention == "cudnn" and m.dtype == "float32"),
             "model.attention=cudnn: needs model.dtype bfloat16 or float16 (cuDNN flash "
             "attention has no float32 kernel)")
    _require(m.hidden_size % m.num_heads == 0, f"model.hidden_size={m.hidden_size}: must be "
             f"divisible by model.num_heads={m.num_heads}")
    _require(m.num_heads % tensor == 0, f"model.num_heads={m.num_heads}: must be divisible "
             f"by parallel.tensor={tensor}")
    _require(m.num_heads % m.kv_heads == 0,
             f"model.num_kv_heads={m.num_kv_heads}: must divide model.num_heads={m.num_heads}")
    _require(m.kv_heads % tensor == 0 or tensor % m.kv_heads == 0,
             f"model.num_kv_heads={m.kv_heads}: must be a multiple or a divisor of "
             f"parallel.tensor={tensor}")
    _require(m.ffn % tensor == 0,
             f"model.ffn_size={m.ffn}: must be divisible by parallel.tensor={tensor}")
    c = par.context
    _require(m.seq_len % (2 * c) == 0 or c == 1,
             f"model.seq_len={m.seq_len}: parallel.context={c} needs it divisible by "
             f"2 x context = {2 * c} (each rank holds two chunks)")
    chunk = m.seq_len // (2 * c)  # a ring block part's queries (and keys) a rank
    _require(c == 1 or m.kernels != "pallas" or par.context_attention != "ring"
             or chunk % 128 == 0 or (chunk <= 128 and chunk & (chunk - 1) == 0),
             f"model.seq_len={m.seq_len}: the ring's Pallas flash blocks (model.kernels="
             f"pallas) need seq_len / (2 x parallel.context) = {chunk} a multiple of 128 "
             "or a power of two below it (the kernels' tiles); or set model.kernels=xla")
    _require(not par.sequence_parallel or m.seq_len % (c * tensor) == 0,
             f"model.seq_len={m.seq_len}: parallel.sequence_parallel needs it divisible by "
             f"parallel.context x parallel.tensor = {c * tensor}")
    _require(m.document_end < m.vocab_size,
             f"model.document_end={m.document_end}: must be a token id below "
             f"model.vocab_size={m.vocab_size} (-1: none)")


def _validate_moe(config: Config) -> None:
    """The mixture of experts: which families have it (Family.experts), the router's top
    k, the widths tensor parallelism splits, and expert parallelism's share of the data
    ranks."""
    m, par = config.model, config.parallel
    moe_keys = ("moe_every", "moe_ffn", "moe_shared_ffn", "moe_shared_gate", "moe_capacity",
                "moe_bias_rate", "moe_z_loss", "moe_router", "moe_norm_topk", "moe_top_k",
                "moe_aux_loss")
    if not m.moe:
        default = ModelConfig()
        for key in moe_keys:
            _require(getattr(m, key) == getattr(default, key),
                     f"model.{key}={getattr(m, key)}: only a mixture of experts reads it "
                     "(set model.moe_experts)")
        _require(par.expert == 1, f"parallel.expert={par.expert}: needs a mixture of "
                 "experts (model.moe_experts > 0)")
        return
    with_experts = [name for name, f in FAMILIES.items() if f.experts]  # (Family.experts)
    _require(FAMILIES[m.arch].experts, f"model.moe_experts={m.moe_experts}: "
             f"model.arch={m.arch} has no mixture of experts ({' and '.join(with_experts)} "
             "have)")
    _require(1 <= m.moe_top_k <= m.moe_experts, f"model.moe_top_k={m.moe_top_k}: must be "
             f"between 1 and model.moe_experts={m.moe_experts}")
    _require(m.num_layers % m.moe_every == 0,
             f"model.moe_every={m.moe_every}: must divide "
             f"model.num_layers={m.num_layers} (every k-th layer is a mixture)")
    _require(m.expert_ffn % par.tensor == 0, f"model.moe_ffn={m.expert_ffn}: must be "
             f"divisible by parallel.tensor={par.tensor} (each expert's width is split)")
    _require(m.moe_shared_ffn % par.tensor == 0, f"model.moe_shared_ffn={m.moe_shared_ffn}: "
             f"must be divisible by parallel.tensor={par.tensor}")
    _require(not m.moe_shared_gate or m.moe_shared_ffn,
             "model.moe_shared_gate=true: needs shared experts (model.moe_shared_ffn > 0)")
    _require(not (m.moe_bias_rate and config.offload.optimizer),
             f"model.moe_bias_rate={m.moe_bias_rate}: the balance bias is moved on the "
             "device after the update, which offload.optimizer=true streams from host "
             "memory; set one of them off")
    _require(m.moe_experts % par.expert == 0, f"parallel.expert={par.expert}: must divide "
             f"model.moe_experts={m.moe_experts}")
    _require(par.data % par.expert == 0, f"parallel.expert={par.expert}: must divide "
             f"parallel.data={par.data} (expert ranks are data ranks)")
    _require(not par.fsdp_group or par.data % (par.expert * par.fsdp_group) == 0,
             f"parallel.fsdp_group={par.fsdp_group}: parallel.expert x fsdp_group = "
             f"{par.expert * par.fsdp_group} must divide parallel.data={par.data}")


def _validate_parallel(config: Config) -> None:
    """FSDP groups, what a pipeline can offload, stages and the schedule's own rules."""
    m, par = config.model, config.parallel
    _require(par.fsdp or not par.fsdp_group,
             f"parallel.fsdp_group={par.fsdp_group}: needs parallel.fsdp=true")
    _require(not par.fsdp_group or par.data % par.fsdp_group == 0,
             f"parallel.fsdp_group={par.fsdp_group}: must divide parallel.data={par.data}")
    _require(not (config.offload.activations and par.pipe > 1),
             "offload.activations=true: needs parallel.pipe=1 (a pipeline keeps its "
             "activations in its stash; parallel.stash=inputs keeps only the stage inputs)")
    stages = par.pipe * par.chunks
    units = "" if m.unit == 1 else (f" / model.moe_every={m.moe_every} (a stage holds "
                                     f"whole units of moe_every layers) = {m.units}")
    _require(m.units % stages == 0,
             f"model.num_layers={m.num_layers}{units}: must be divisible by parallel.pipe x "
             f"parallel.chunks = {par.pipe} x {par.chunks} = {stages}")
    _require(par.schedule != "zb-v" or par.chunks == 2,
             f"parallel.chunks={par.chunks}: parallel.schedule=zb-v needs parallel.chunks=2 "
             "(its V: chunk 0 down the ranks, chunk 1 back up)")
    _require(par.chunks == 1 or "interleaved" in par.schedule or par.schedule == "zb-v",
             f"parallel.chunks={par.chunks}: more than one chunk per rank needs "
             f"parallel.schedule=interleaved, zb-interleaved or zb-v (got {par.schedule})")
    if par.pipe > 1:
        try:
            make_schedule(par.schedule, par.pipe, par.microbatches, par.chunks)
        except ScheduleError as e:
            raise ConfigError(f"parallel.schedule={par.schedule}: {e}") from None


def _validate_training(config: Config) -> None:
    """The batch's split into microbatches; float16's loss scaling; the learning rates."""
    par, tr, opt = config.parallel, config.train, config.optimizer
    rows = par.data * par.microbatches
    _require(tr.global_batch % rows == 0,
             f"train.global_batch={tr.global_batch}: must be divisible by parallel.data x "
             f"parallel.microbatches = {par.data} x {par.microbatches} = {rows}")
    _require(not (config.model.dtype == "float16" and opt.loss_scale != "dynamic"),
             f"model.dtype=float16: needs optimizer.loss_scale=dynamic (got {opt.loss_scale})")
    _require(opt.min_lr <= opt.lr,
             f"optimizer.min_lr={opt.min_lr}: must be <= optimizer.lr={opt.lr}")


def _validate_data(config: Config) -> None:
    """Packed rows are for the families that read model.document_end (Family.options);
    data.eod_id is a token id (the corpus's own rules are preflight.py's)."""
    data, m = config.data, config.model
    packing = [name for name, f in FAMILIES.items() if "document_end" in f.options]
    _require(not data.pack or m.arch in packing,
             f"data.pack=true: model.arch={m.arch} has no packed rows (they are for "
             f"{', '.join(packing)}); set data.pack=false")
    _require(-1 <= data.eod_id < m.vocab_size,
             f"data.eod_id={data.eod_id}: must be a token id below model.vocab_size="
             f"{m.vocab_size} (-1: none)")


def _validate_checkpoint(config: Config) -> None:
    """The local tier needs its directory; `{process}` is the one placeholder there."""
    ck = config.checkpoint
    _require(not ck.local_every or ck.local_dir,
             f"checkpoint.local_every={ck.local_every}: needs checkpoint.local_dir, a "
             "directory on each node's own storage (e.g. /dev/shm/jaxptd); or set "
             "checkpoint.local_every=0")
    braces = ck.local_dir.replace("{process}", "")
    _require("{" not in braces and "}" not in braces,
             f"checkpoint.local_dir={ck.local_dir}: the only placeholder is {{process}} "
             "(the process index)")


def _validate_runtime(config: Config) -> None:
    """runtime.cpu_devices counts one process's devices; the mesh spans all processes."""
    rt = config.runtime
    _require(rt.process_id >= -1, f"runtime.process_id={rt.process_id}: must be >= 0 (-1: unset)")
    _require(rt.num_processes == 0 or rt.process_id < rt.num_processes,
             f"runtime.process_id={rt.process_id}: must be < runtime.num_processes="
             f"{rt.num_processes}")
    _require(rt.watchdog_factor == 0 or rt.watchdog_factor >= 2,
             f"runtime.watchdog_factor={rt.watchdog_factor:g}: must be 0 (no watchdog) or at "
             "least 2 (a limit near the median step time ends healthy runs)")
    _require(rt.straggler_ratio == 0 or rt.straggler_ratio > 1,
             f"runtime.straggler_ratio={rt.straggler_ratio:g}: must be 0 (no warning) or "
             "above 1")
    if rt.cpu_devices and (rt.num_processes or rt.cpu_devices > config.num_devices):
        processes = max(rt.num_processes, 1)
        check_device_count(config, rt.cpu_devices * processes,
                           f"runtime.cpu_devices x {processes} processes")
    elif rt.cpu_devices:
        _require(config.num_devices % rt.cpu_devices == 0,
                 f"runtime.cpu_devices={rt.cpu_devices}: the devices of one process must "
                 f"divide data x pipe x context x tensor = {config.num_devices}")


def check_device_count(config: Config, devices: int, source: str) -> None:
    """The mesh rule: data x pipe x context x tensor must equal the number of devices."""
    par = config.parallel
    _require(
        config.num_devices == devices,
        f"parallel.data x parallel.pipe x parallel.context x parallel.tensor = {par.data} x "
        f"{par.pipe} x {par.context} x {par.tensor} = {config.num_devices}: must equal the "
        f"device count {devices} ({source})",
    )
