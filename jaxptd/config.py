"""Configuration: frozen dataclasses read from YAML with dotted ``key=value`` overrides.

Owns every rule a user can break in a config file but a model family's own (its module in
jaxptd/arch/ declares those, and the options only it reads; `validate` asks the registry).
All validation happens in `validate`, before any device work and without JAX, and every
failure is a ``ConfigError`` whose message is one line naming the key, the value and the
rule; the entry points print it as ``error: ...`` and exit 2.

A YAML file holds only what differs from the defaults below, as sections
(``model:``, ``parallel:``, ...). Overrides use the same names: ``parallel.tensor=4``.
The device-count rule (data x pipe x tensor == devices) is checked here against
``runtime.cpu_devices`` when it is set, and by ``mesh.py`` against the real device count.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from jaxptd.arch import FAMILIES
from jaxptd.pipeline.schedules import ScheduleError, make_schedule
from jaxptd.target import NAMES as TARGET_NAMES


class ConfigError(ValueError):
    """A user-caused configuration error; its message is one line."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt"  # gpt (the papers' GPT-2-shaped decoder) | llama | bert
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    seq_len: int = 128
    vocab_size: int = 257  # the tokenizer's vocabulary; padded for tensor parallelism
    dropout: float = 0.0
    dtype: str = "float32"  # compute dtype; master weights are always float32
    kernels: str = "xla"  # fused softmax / bias-GeLU: plain XLA or Pallas kernels
    attention: str = "xla"  # xla | cudnn (flash attention on GPU; the XLA path elsewhere)
    # activation recomputation: none | minimal (keep matmul outputs and flash attention's
    # own residuals, recompute norms and activations) | selective (attention core) | full
    remat: str = "none"
    # layers as one scan (true: one layer's program, per-layer stacks of kept values) or
    # unrolled (false: no stacks to fill and copy, longer compiles); auto: unrolled on a GPU
    scan_layers: str = "auto"
    init_std: float = 0.02
    layernorm_eps: float = 1e-5  # LayerNorm's (RMSNorm's for llama) epsilon
    ffn_size: int = 0  # MLP hidden width; 0: 4 x hidden_size
    num_kv_heads: int = 0  # llama: key/value heads (grouped-query attention); 0: num_heads
    rope_theta: float = 10000.0  # llama: base of the rotary position embedding
    gelu: str = "tanh"  # gpt, bert: tanh (GPT-2's, Megatron's approximation) | erf (exact)
    # bert: pre (Megatron's rearranged LayerNorm, its Figure 7) | post (the original
    # BERT's, transformers' BertModel; as Megatron's apply_residual_connection_post_layernorm)
    norm_position: str = "pre"
    special_ids: str = ""  # bert: "PAD,CLS,SEP,MASK" ids; "": the top 4 of vocab_size

    @property
    def ffn(self) -> int:
        """The MLP's hidden width."""
        return self.ffn_size or 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads (fewer than num_heads: grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def bert_specials(self) -> tuple[int, ...]:
        """BERT's [PAD], [CLS], [SEP], [MASK] ids: model.special_ids, else the top 4 ids of
        vocab_size (which the data then may not use)."""
        if not self.special_ids:
            return tuple(range(self.vocab_size - 4, self.vocab_size))
        return tuple(int(i) for i in self.special_ids.split(","))

    def padded_vocab(self, tensor: int) -> int:
        """Vocabulary rounded up to a multiple of 128 x tensor, as Megatron pads it."""
        multiple = 128 * tensor
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass(frozen=True)
class ParallelConfig:
    data: int = 1
    pipe: int = 1
    tensor: int = 1
    microbatches: int = 1  # per data-parallel rank and step
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 | zb-interleaved (pipe > 1)
    chunks: int = 1  # model chunks per pipe rank (v of the interleaved schedules)
    stash: str = "activations"  # pipe > 1 keeps: activations | inputs (recompute the stage)
    round_form: str = "auto"  # pipe > 1: cond | steady | masked (auto: cond on CPU, steady GPU)
    sequence_parallel: bool = False  # activations outside attention/MLP split [b, s/t, h]
    fsdp: bool = False  # ZeRO-3: parameters, gradients, optimizer state sharded over data
    fsdp_group: int = 0  # data ranks per FSDP sharding group (HSDP); 0: all of them
    # what FSDP gathers at once: a layer (gathered ahead of its use, beside the layer
    # before: overlapped) or one matmul's weight (seeds/003's unit: a quarter of a GPT
    # layer's memory, gathered where it is used: not overlapped)
    fsdp_unit: str = "layer"

    @property
    def fsdp_size(self) -> int:
        """Data ranks one FSDP group shards over (1 without FSDP)."""
        return (self.fsdp_group or self.data) if self.fsdp else 1


@dataclass(frozen=True)
class DataConfig:
    path: str = "pystdlib"  # a prepared token directory, or the built-in corpus name


@dataclass(frozen=True)
class OptimizerConfig:
    # adamw (two float32 moments a parameter) | sgd (with momentum: one; without: none;
    # weight_decay as L2 added to the gradient, torch.optim.SGD's)
    name: str = "adamw"
    momentum: float = 0.9  # sgd: heavy-ball momentum (0: plain SGD)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    decay_steps: int = 0  # 0: decay over train.steps
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    zero1: bool = False  # shard optimizer state over the data axis
    loss_scale: str = "none"  # none | dynamic (required for model.dtype float16)
    grad_reduce_dtype: str = "float32"  # data-parallel gradient reductions (and FSDP gathers)
    # reduce each layer's gradient inside the last microbatch's backward (pipe = 1): auto =
    # when it costs no memory (one microbatch); true also with several (a second copy of
    # the layer stack's buffers: XLA keeps the accumulation loop's and the last one's apart)
    overlap_grad_reduce: str = "auto"


@dataclass(frozen=True)
class OffloadConfig:
    optimizer: bool = False  # optimizer state and float32 masters in host memory
    activations: bool = False  # each layer's checkpointed input in host memory (pipe = 1)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per step
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 50  # 0 disables validation
    eval_batches: int = 4
    wandb_project: str = ""  # also log to Weights & Biases (needs `pip install wandb`)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <train.run_dir>/checkpoints
    every: int = 100  # 0 disables saving
    keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class RuntimeConfig:
    cpu_devices: int = 0  # simulated CPU devices per process; 0: data x pipe x tensor / processes
    # the hardware (jaxptd/target.py): auto = what the process sees; a named target must be
    # of the devices' platform (cpu, or a GPU: gpu = any, h100, h200, a100, a100-40)
    target: str = "auto"
    # Multi-process start (jaxptd/distributed.py). Unset keys fall back to JAXPTD_COORDINATOR,
    # JAXPTD_NUM_PROCESSES, JAXPTD_PROCESS_ID, then to SLURM's environment under srun, then
    # to a single process.
    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # 0: from the environment, else 1
    process_id: int = -1  # -1: from the environment
    init_timeout_s: int = 300  # how long processes wait for each other at start
    heartbeat_timeout_s: int = 30  # a silent process is declared dead after this
    collective_logs: bool = False  # show the collectives' (gloo's) connection messages


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.train.run_dir, "checkpoints")

    @property
    def decay_length(self) -> int:
        """Steps the learning rate's cosine decay spans (optimizer.decay_steps, else
        train.steps; see `continued` for a resumed run)."""
        return self.optimizer.decay_steps or self.train.steps

    @property
    def num_devices(self) -> int:
        return self.parallel.data * self.parallel.pipe * self.parallel.tensor

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch on one data-parallel rank (b in the PTD-P paper)."""
        return self.train.global_batch // (self.parallel.data * self.parallel.microbatches)

    @property
    def peels_last_microbatch(self) -> bool:
        """Whether the unpipelined step runs its last microbatch outside the accumulation
        scan, to reduce each layer's gradient in its backward (optimizer.overlap_grad_reduce
        with several microbatches)."""
        return (self.parallel.pipe == 1 and self.parallel.microbatches > 1
                and self.optimizer.overlap_grad_reduce == "true")

    @property
    def overlaps_grad_reduce(self) -> bool:
        """Whether the unpipelined step reduces gradients inside the backward."""
        setting = self.optimizer.overlap_grad_reduce
        return self.parallel.pipe == 1 and (setting == "true" or (
            setting == "auto" and self.parallel.microbatches == 1))

    @property
    def reduces_chunks_early(self) -> bool:
        """Whether the pipelined step reduces each chunk's layer gradients as soon as every
        rank has run the chunk's last backward slot, beside the rounds after it
        (optimizer.overlap_grad_reduce true, or auto with ZeRO-1, where the reduced chunk
        held beside the accumulator is 1/data of it). It matters with chunks > 1: chunk 0
        ends last."""
        setting = self.optimizer.overlap_grad_reduce
        return self.parallel.pipe > 1 and (setting == "true" or (
            setting == "auto" and self.optimizer.zero1 and self.parallel.data > 1))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def moments(self) -> int:
        """float32 optimizer-state arrays per parameter: Adam's two, SGD's momentum (or
        none without it)."""
        opt = self.optimizer
        return 2 if opt.name == "adamw" else int(opt.momentum > 0)


CHOICES = {
    "model.arch": tuple(FAMILIES),
    "optimizer.name": ("adamw", "sgd"),
    "optimizer.grad_reduce_dtype": ("float32", "bfloat16"),
    "optimizer.overlap_grad_reduce": ("auto", "true", "false"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.kernels": ("xla", "pallas"),
    "model.attention": ("xla", "cudnn"),
    "model.remat": ("none", "minimal", "selective", "full"),
    "model.scan_layers": ("auto", "true", "false"),
    "parallel.fsdp_unit": ("layer", "matmul"),
    "model.gelu": ("tanh", "erf"),
    "model.norm_position": ("pre", "post"),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-interleaved"),
    "parallel.stash": ("activations", "inputs"),
    "parallel.round_form": ("auto", "cond", "steady", "masked"),
    "optimizer.loss_scale": ("none", "dynamic"),
    "runtime.target": TARGET_NAMES,
}
POSITIVE = (
    "model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_len",
    "model.vocab_size", "parallel.data", "parallel.pipe", "parallel.tensor",
    "parallel.microbatches", "parallel.chunks", "train.steps", "train.global_batch",
    "train.log_every", "train.eval_batches", "checkpoint.keep", "runtime.init_timeout_s",
    "runtime.heartbeat_timeout_s",
)
NON_NEGATIVE = (
    "optimizer.warmup_steps", "optimizer.decay_steps", "train.eval_every",
    "checkpoint.every", "optimizer.weight_decay", "optimizer.clip_norm", "optimizer.lr",
    "optimizer.min_lr", "model.init_std", "runtime.cpu_devices", "model.ffn_size",
    "model.num_kv_heads", "parallel.fsdp_group",
    "runtime.num_processes",
)


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Checks one leaf against its dataclass annotation ('int', 'float', 'str', 'bool')."""
    if annotation == "bool":
        if isinstance(value, bool):
            return value
    elif annotation == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation == "str":
        if isinstance(value, bool):  # YAML reads true/false as booleans
            return "true" if value else "false"
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}={value!r}: expected {annotation}, got {type(value).__name__}")


def _section_types(section_cls) -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(section_cls)}


def _build(tree: dict[str, Any]) -> Config:
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    built = {}
    for name, values in tree.items():
        if name not in sections:
            raise ConfigError(f"{name}: unknown section (known: {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{name}={values!r}: a section must be a mapping of keys")
        section_cls = sections[name]
        types = _section_types(section_cls)
        if name == "runtime" and "platform" in values and "target" not in values:
            # runtime.platform (auto | cpu | gpu) was renamed runtime.target: configs and
            # checkpoints written before still load
            values = {("target" if k == "platform" else k): v for k, v in values.items()}
        kwargs = {}
        for key, value in values.items():
            dotted = f"{name}.{key}"
            if key not in types:
                raise ConfigError(f"{dotted}: unknown key (known: {', '.join(types)})")
            kwargs[key] = _coerce(dotted, value, types[key])
        built[name] = section_cls(**kwargs)
    return Config(**built)


def _set_dotted(tree: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"{override!r}: an override must look like section.key=value")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{dotted!r}: an override key must be section.key, e.g. parallel.tensor")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    section = tree.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"{parts[0]}: a section must be a mapping of keys")
    section[parts[1]] = value


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Reads YAML `path` (None: defaults only), applies overrides, validates.

    Raises ConfigError (one line) for a missing or malformed file, unknown keys, wrong
    types and impossible combinations.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: file not found") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"--config {path}: not a readable file ({e.strerror})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "invalid YAML"
            raise ConfigError(f"--config {path}: malformed YAML{where}: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
        tree = loaded or {}
    for override in overrides:
        _set_dotted(tree, override)
    config = _build(tree)
    validate(config)
    return config


def describe_keys() -> str:
    """Every section.key with its type and default (and choices), from the dataclasses."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        for f in dataclasses.fields(section.default_factory):
            key = f"{section.name}.{f.name}"
            choices = f" ({' | '.join(CHOICES[key])})" if key in CHOICES else ""
            lines.append(f"  {key:<30} {f.type:<6} default {f.default!r}{choices}")
    return "\n".join(lines)


# Keys a resumed run may change without a warning: the layout, where files go, how often
# to log, save and evaluate, and how long to train.
RESUME_FREE = ("parallel.", "runtime.", "checkpoint.", "train.steps", "train.run_dir",
               "train.log_every", "train.eval_every", "train.eval_batches",
               "train.wandb_project", "model.kernels", "model.attention", "model.remat",
               "model.scan_layers")


def continued(config: Config, saved: dict) -> tuple[Config, str | None]:
    """`config` for a run that continues one written with the config `saved` (a
    to_dict()), and a note when that changed it.

    The learning-rate schedule keeps its length: with optimizer.decay_steps 0 (decay over
    train.steps) it is set to the saved run's decay length, so raising train.steps to go
    on does not stretch the cosine under the steps already trained (their logged rates
    stay the schedule's); past that length the rate stays at optimizer.min_lr. A
    decay_steps given explicitly wins, as Megatron's --lr-decay-iters does. Setting it
    explicitly also carries the length into the config.yaml and checkpoints this run
    writes, so later resumes keep it too.
    """
    old = saved.get("optimizer", {})
    length = old.get("decay_steps") or saved.get("train", {}).get("steps")
    if config.optimizer.decay_steps or not length or (
            length == config.train.steps and not old.get("decay_steps")):
        return config, None
    kept = dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, decay_steps=int(length)))
    if length == config.train.steps:
        return kept, None
    return kept, (f"train.steps={config.train.steps}: the learning-rate schedule keeps the "
                  f"length of the run this one continues (optimizer.decay_steps={length}), so"
                  f" the rate stays at optimizer.min_lr after step {length}; set "
                  "optimizer.decay_steps to decay over another length")


def changed_keys(saved: dict, config: Config) -> list[str]:
    """'key old -> new' for every setting that differs from the saved config's `saved`
    (a to_dict()), other than RESUME_FREE ones."""
    changes = []
    for section, values in config.to_dict().items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            old = saved.get(section, {}).get(key, value)
            if old != value and not dotted.startswith(RESUME_FREE):
                changes.append(f"{dotted} {old!r} -> {value!r}")
    return changes


def from_dict(tree: dict[str, Any]) -> Config:
    """A validated Config from {section: {key: value}} (e.g. a checkpoint's record of its
    config); raises ConfigError like load_config."""
    config = _build(tree)
    validate(config)
    return config


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
    for message in FAMILIES[config.model.arch].config_errors(config.model):
        raise ConfigError(message)
    _validate_parallel(config)
    _validate_training(config)
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
    _require(not (m.attention == "cudnn" and m.dropout > 0),
             f"model.dropout={m.dropout}: model.attention=cudnn has no attention dropout; "
             "set model.dropout=0 or model.attention=xla")
    _require(not (m.attention == "cudnn" and m.dtype == "float32"),
             "model.attention=cudnn: needs model.dtype bfloat16 or float16 (cuDNN flash "
             "attention has no float32 kernel)")
    _require(m.hidden_size % m.num_heads == 0, f"model.hidden_size={m.hidden_size}: must be "
             f"divisible by model.num_heads={m.num_heads}")
    _require(m.num_heads % tensor == 0, f"model.num_heads={m.num_heads}: must be divisible "
             f"by parallel.tensor={tensor}")
    _require(not par.sequence_parallel or m.seq_len % tensor == 0,
             f"model.seq_len={m.seq_len}: parallel.sequence_parallel needs it divisible by "
             f"parallel.tensor={tensor}")
    _require(m.num_heads % m.kv_heads == 0,
             f"model.num_kv_heads={m.num_kv_heads}: must divide model.num_heads={m.num_heads}")
    _require(m.kv_heads % tensor == 0 or tensor % m.kv_heads == 0,
             f"model.num_kv_heads={m.kv_heads}: must be a multiple or a divisor of "
             f"parallel.tensor={tensor}")
    _require(m.ffn % tensor == 0,
             f"model.ffn_size={m.ffn}: must be divisible by parallel.tensor={tensor}")


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
    _require(m.num_layers % stages == 0,
             f"model.num_layers={m.num_layers}: must be divisible by parallel.pipe x "
             f"parallel.chunks = {par.pipe} x {par.chunks} = {stages}")
    _require(par.chunks == 1 or "interleaved" in par.schedule,
             f"parallel.chunks={par.chunks}: more than one chunk per rank needs "
             f"parallel.schedule=interleaved or zb-interleaved (got {par.schedule})")
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


def _validate_runtime(config: Config) -> None:
    """runtime.cpu_devices counts one process's devices; the mesh spans all processes."""
    rt = config.runtime
    _require(rt.process_id >= -1, f"runtime.process_id={rt.process_id}: must be >= 0 (-1: unset)")
    _require(rt.num_processes == 0 or rt.process_id < rt.num_processes,
             f"runtime.process_id={rt.process_id}: must be < runtime.num_processes="
             f"{rt.num_processes}")
    if rt.cpu_devices and (rt.num_processes or rt.cpu_devices > config.num_devices):
        processes = max(rt.num_processes, 1)
        check_device_count(config, rt.cpu_devices * processes,
                           f"runtime.cpu_devices x {processes} processes")
    elif rt.cpu_devices:
        _require(config.num_devices % rt.cpu_devices == 0,
                 f"runtime.cpu_devices={rt.cpu_devices}: the devices of one process must "
                 f"divide data x pipe x tensor = {config.num_devices}")


def check_device_count(config: Config, devices: int, source: str) -> None:
    """The mesh rule: data x pipe x tensor must equal the number of devices."""
    par = config.parallel
    _require(
        config.num_devices == devices,
        f"parallel.data x parallel.pipe x parallel.tensor = {par.data} x {par.pipe} x "
        f"{par.tensor} = {config.num_devices}: must equal the device count {devices} "
        f"({source})",
    )
