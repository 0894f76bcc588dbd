"""The config's schema: its frozen dataclasses, one per YAML section, their defaults and
the values derived from them (`Config.microbatch_size`, `ModelConfig.padded_vocab`, ...),
and `ConfigError`, the one exception every config rule raises.

Each field's comment says what the key means; the annotations ('int', 'float', 'str',
'bool') are what `load.py` coerces a YAML or override value to.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A user-caused configuration error; its message is one line."""


@dataclass(frozen=True)
class ModelConfig:
    # gpt (the papers' GPT-2-shaped decoder: learned positions, LayerNorm, GeLU, biases,
    # tied embedding) | llama (RMSNorm, rotary positions, SwiGLU, untied, no biases) | bert
    # (Megatron's BERT: a bidirectional encoder, masked-LM and sentence-order losses)
    arch: str = "gpt"
    num_layers: int = 4  # transformer layers (L)
    hidden_size: int = 128  # the residual stream's width (h)
    num_heads: int = 4  # attention heads (a); each of width hidden_size / num_heads
    seq_len: int = 128  # tokens a row (s); gpt and bert learn a position for each
    # the tokenizer's vocabulary (bert: with its 4 special ids unless special_ids places
    # them inside it); padded to a multiple of 128 x parallel.tensor with zero rows that stay
    # zero and take no loss (the weights are drawn at this size: one model at every layout)
    vocab_size: int = 257
    dropout: float = 0.0  # on the embeddings, attention probabilities and residual branches
    # compute dtype: float32 | bfloat16 | float16 (with optimizer.loss_scale=dynamic); the
    # master weights are always float32
    dtype: str = "float32"
    # FP8 GEMMs for the layers' linears (jaxptd/model/fp8.py): none | tensorwise (e4m3
    # weights and activations, e5m2 output gradients, each tensor scaled by its own amax
    # this step, f32 accumulation) | delayed (scaled by the largest amax of the last
    # fp8_history steps, x 2^fp8_margin: Transformer Engine's recipe, the histories part of
    # the parameters); embedding, head, norms, attention core stay in dtype
    fp8: str = "none"
    fp8_history: int = 16  # delayed: the steps of amax each linear remembers
    fp8_margin: int = 0  # delayed: scales this power of 2 larger (headroom for growth)
    # fused softmax / bias-GeLU and the context ring's attention blocks: xla | pallas
    # (pallas_kernels/: Pallas kernels, interpret mode on CPU)
    kernels: str = "xla"
    # xla | cudnn (cuDNN flash attention on a GPU: 16-bit dtypes, no attention dropout; the
    # XLA path elsewhere) | flash (Pallas flash attention: head width <= 256, any GPU, no
    # attention dropout, no mask beyond causal: BERT's padding and decoding take XLA's;
    # interpret mode off a GPU)
    attention: str = "xla"
    # activation recomputation: none | minimal (keep matmul outputs and flash attention's
    # own residuals, recompute norms and activations) | minimal_mlp (the same but q, k, v:
    # the attention's projection again) | selective (the attention core, Megatron's: drops
    # the [s, s] probabilities) | full (each layer again from its input)
    remat: str = "none"
    # layers as one scan (true: one layer's program, per-layer stacks of kept values) or
    # unrolled (false: no stacks to fill and copy, longer compiles); auto: scanned on CPU,
    # unrolled on a GPU
    scan_layers: str = "auto"
    init_std: float = 0.02  # weights drawn N(0, init_std); residual outputs / sqrt(2 L)
    layernorm_eps: float = 1e-5  # LayerNorm's (RMSNorm's for llama) epsilon
    ffn_size: int = 0  # MLP hidden width (SwiGLU's for llama); 0: 4 x hidden_size
    # llama: key/value heads (grouped-query attention), split over the tensor ranks when
    # parallel.tensor divides them, else replicated; 0: num_heads
    num_kv_heads: int = 0
    # llama: biases on the query, key and value projections (Qwen2's and Qwen2-MoE's; zeros
    # at initialisation)
    qkv_bias: bool = False
    rope_theta: float = 10000.0  # llama: base of the rotary position embedding
    # llama: rotary frequency scaling, none | llama3 (Llama 3.1's: frequencies whose
    # wavelength exceeds rope_original_seq_len / rope_low_freq_factor divided by rope_factor,
    # those below rope_original_seq_len / rope_high_freq_factor kept, interpolated between)
    rope_scaling: str = "none"
    rope_factor: float = 8.0  # llama3: how much longer the context than in pretraining
    rope_low_freq_factor: float = 1.0  # llama3: bounds the scaled (low) frequencies
    rope_high_freq_factor: float = 4.0  # llama3: bounds the kept (high) ones; > low
    rope_original_seq_len: int = 8192  # llama3: the context length of pretraining
    # gpt, bert: tanh (GPT-2's and Megatron's approximation) | erf (exact, the original
    # BERT's; the Pallas bias-GeLU kernel is tanh's, so erf takes XLA's)
    gelu: str = "tanh"
    # bert: pre (Megatron's rearranged LayerNorm, its Figure 7) | post (the original
    # BERT's, transformers' BertModel; as Megatron's apply_residual_connection_post_layernorm)
    norm_position: str = "pre"
    # bert: "PAD,CLS,SEP,MASK" ids inside the vocabulary (e.g. 0,101,102,103: a Hugging
    # Face tokenizer's); "": the top 4 ids of vocab_size, which the data may not use
    special_ids: str = ""
    # decoders: the id that ends a document in packed rows (set by data.pack to the
    # corpus's eot id, or directly); attention never crosses it, positions restart after it and the
    # target after it takes no loss. -1: rows are one stream (attention spans documents)
    document_end: int = -1
    # gpt, llama: a mixture of experts (jaxptd/model/moe.py): routed experts a layer, of
    # which each token takes moe_top_k, plus optional shared experts; 0: the dense MLP
    moe_experts: int = 0
    # every moe_every-th layer is a mixture (layers k-1, 2k-1, ..., as Qwen2-MoE's
    # decoder_sparse_step and Llama 4's interleave step), the others keep the dense MLP
    moe_every: int = 1
    moe_top_k: int = 2  # experts each token is sent to
    # a routed expert's hidden width (fine-grained experts); 0: ffn_size's
    moe_ffn: int = 0
    # hidden width of the always-active shared expert(s), a dense MLP (DeepSeek's n shared
    # experts of width f: n f); 0: none
    moe_shared_ffn: int = 0
    moe_shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x w) (Qwen2-MoE)
    # the router's scores: softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3; normalised per
    # token for the balance loss)
    moe_router: str = "softmax"
    moe_norm_topk: bool = True  # the top-k scores renormalised to sum to 1 (the weights)
    # expert capacity factor: each expert takes at most ceil(factor x tokens x top_k /
    # experts) of a rank's microbatch tokens, first choices first, the rest dropped (counted
    # in the moe_dropped metric); 0: dropless (grouped GEMMs)
    moe_capacity: float = 0.0
    # weight of the Switch/GShard load-balancing loss E sum_i f_i P_i, each sequence its
    # group (1 when balanced), per layer
    moe_aux_loss: float = 0.01
    moe_z_loss: float = 0.0  # weight of the router z-loss, logsumexp(logits)^2 (ST-MoE: 1e-3)
    # DeepSeek-V3's auxiliary-loss-free balance: a per-expert bias on the scores that pick
    # the top k, moved by this rate towards the mean load after every step; 0: off
    moe_bias_rate: float = 0.0

    @property
    def moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts."""
        return self.moe_experts > 0

    @property
    def unit(self) -> int:
        """Layers per element of the layer stack: moe_every with a mixture of experts (a
        unit of moe_every - 1 dense layers and a mixture, model/stack.py's Unit), else 1."""
        return self.moe_every if self.moe else 1

    @property
    def units(self) -> int:
        """Elements of the layer stack: the leading axis of every layer leaf."""
        return self.num_layers // self.unit

    def layer_path(self, j: int) -> tuple:
        """Where layer j of a unit lives in the layer stack's tree: () with one layer a
        unit, else ('layer_j',)."""
        return () if self.unit == 1 else (f"layer_{j}",)

    @property
    def expert_ffn(self) -> int:
        """A routed expert's hidden width."""
        return self.moe_ffn or self.ffn

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
    data: int = 1  # data-parallel ranks (d), replicas of the model (FSDP: its shards)
    pipe: int = 1  # pipeline stages (p), across hosts
    tensor: int = 1  # tensor-parallel ranks (t), inside one host
    microbatches: int = 1  # m, per data-parallel rank and step
    # pipe > 1: gpipe | 1f1b | interleaved | zb-h1 | zb-interleaved | zb-v (chunks=2)
    # (docs/schedules.md)
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per pipe rank (v of the interleaved schedules; zb-v: 2)
    stash: str = "activations"  # pipe > 1 keeps: activations | inputs (recompute the stage)
    # pipe > 1: cond (idle slots skipped by a conditional) | steady (rounds where every rank
    # works run without conditionals) | masked (none: idle slots computed and discarded);
    # auto: cond on CPU, steady on a GPU
    round_form: str = "auto"
    # Megatron's sequence parallelism: norms, dropouts and the residual stream split over
    # tensor as [b, s/t, h]; a layer's all-reduces become an all-gather and a reduce-scatter
    sequence_parallel: bool = False
    # context parallelism: every activation's sequence split over `context` ranks (the mesh
    # axis between pipe and tensor), each holding chunks i and 2c-1-i (causal balance)
    context: int = 1
    # ring (key/value blocks passed round the context ranks beside the attention of the
    # current block; flash attention's backward) | allgather (all ranks' keys and values
    # gathered, one masked attention: Llama 3's choice)
    context_attention: str = "ring"
    fsdp: bool = False  # ZeRO-3: parameters, gradients, optimizer state sharded over data
    fsdp_group: int = 0  # data ranks per FSDP sharding group (HSDP); 0: all of them
    # what FSDP gathers at once: a layer (gathered ahead of its use, beside the layer
    # before: overlapped) or one matmul's weight (the PyTorch FSDP on AWS runs' unit: a
    # quarter of a GPT layer's memory, gathered where it is used: not overlapped)
    fsdp_unit: str = "layer"
    # expert parallelism: the routed experts split over `expert` of the data ranks (the
    # mesh's expert axis, a part of data), tokens sent to their experts' ranks and back by
    # all-to-all; 1: every rank holds every expert
    expert: int = 1

    @property
    def fsdp_size(self) -> int:
        """Data ranks one FSDP group shards over (1 without FSDP): by default every data
        rank of one expert rank's (all of them without expert parallelism)."""
        return (self.fsdp_group or self.data // self.expert) if self.fsdp else 1


@dataclass(frozen=True)
class DataConfig:
    # a prepared token directory (python -m jaxptd.data.prepare), a Megatron-LM dataset's
    # path prefix (PREFIX.bin, PREFIX.idx) or pystdlib (this Python's standard library)
    path: str = "pystdlib"
    # rows hold several documents that do not see each other: model.document_end is set to
    # the corpus's eot id (a directory's meta.json; data.eod_id for Megatron data). The
    # target after each document end takes no loss; the loss (logged, evaluated, and what
    # the gradient is of) is the mean over the targets that do, counted over the global
    # batch, as Megatron-LM's (eod_mask_loss) and transformers' (labels -100) are
    pack: bool = False
    # the id ending each document of a Megatron dataset (its --append-eod token; the format
    # does not record it): what data.pack needs there. -1: unknown
    eod_id: int = -1


@dataclass(frozen=True)
class OptimizerConfig:
    # adamw (two float32 moments a parameter) | sgd (with momentum: one; without: none;
    # weight_decay as L2 added to the gradient, torch.optim.SGD's)
    name: str = "adamw"
    momentum: float = 0.9  # sgd: heavy-ball momentum (0: plain SGD, no state)
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 1e-4  # final learning rate, at the end of the cosine decay
    warmup_steps: int = 20  # linear warm-up from 0, then cosine decay
    # the cosine decay's length; 0: train.steps (on a resume: the length it was trained with)
    decay_steps: int = 0
    # on matrices (not biases or norms): AdamW's decoupled decay, SGD's L2 on the gradient
    weight_decay: float = 0.01
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    clip_norm: float = 1.0  # global gradient-norm clipping; 0: off
    zero1: bool = False  # shard optimizer state over the data axis (ZeRO-1)
    loss_scale: str = "none"  # none | dynamic (required for model.dtype float16)
    # dtype of the data-parallel gradient reductions and FSDP's weight gathers: float32 |
    # bfloat16 (half the bytes, rounded sums)
    grad_reduce_dtype: str = "float32"
    # pipe = 1: reduce each layer's gradient inside the last microbatch's backward: auto =
    # when it costs no memory (one microbatch); true also with several (a second copy of
    # the layer stack's buffers: XLA keeps the accumulation loop's and the last one's apart).
    # pipe > 1: reduce each chunk's gradients between the rounds once its last backward
    # has run (true; auto: with ZeRO-1), else after the schedule
    overlap_grad_reduce: str = "auto"


@dataclass(frozen=True)
class OffloadConfig:
    # optimizer state and float32 masters in host memory (pipe = 1: the gradients too),
    # brought to the device a layer at a time
    optimizer: bool = False
    activations: bool = False  # each layer's checkpointed input in host memory (pipe = 1)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps (raise it to continue a finished run)
    global_batch: int = 16  # sequences per step
    seed: int = 0  # initialisation (the same parameters at every layout), dropout, batches
    # config.yaml, train.log, metrics.jsonl, tensorboard/ and (by default) checkpoints/
    run_dir: str = "runs/default"
    log_every: int = 10  # steps between progress lines and metric records
    eval_every: int = 50  # steps between validation losses; 0 disables validation
    eval_batches: int = 4  # batches of the validation split a validation reads
    wandb_project: str = ""  # also log to Weights & Biases (needs `pip install wandb`)


@dataclass(frozen=True)
class CheckpointConfig:
    # where checkpoints go (multi-host: a shared file system); "": <train.run_dir>/checkpoints
    dir: str = ""
    every: int = 100  # steps between saves; 0: none (checkpoints there are still restored)
    keep: int = 3  # the newest checkpoints kept
    async_save: bool = True  # save in the background while training goes on
    # the local tier (jaxptd/checkpoint/local.py): a directory on each node's own storage
    # (local disk, /dev/shm), "{process}" replaced by the process index; each process's
    # shards also go to a peer process on another node. "": no local tier
    local_dir: str = ""
    # steps between local saves (0: none); a restart resumes from the newest step complete
    # across the local copies or checkpoint.dir, whichever is newer
    local_every: int = 0
    local_keep: int = 2  # the newest local steps each process keeps


@dataclass(frozen=True)
class RuntimeConfig:
    cpu_devices: int = 0  # simulated CPU devices per process; 0: all devices / processes
    # the hardware (jaxptd/runtime/target.py): auto = what the process sees; a named target must be
    # of the devices' platform (cpu, or a GPU: gpu = any, h100, h200, a100, a100-40)
    target: str = "auto"
    # multi-process start (jaxptd/runtime/distributed.py): host:port of process 0; "":
    # JAXPTD_COORDINATOR, else SLURM's environment under srun, else a single process
    coordinator: str = ""
    num_processes: int = 0  # 0: JAXPTD_NUM_PROCESSES, else SLURM's, else 1
    process_id: int = -1  # -1: JAXPTD_PROCESS_ID, else SLURM's
    init_timeout_s: int = 300  # how long processes wait for each other at start
    # a process that sends nothing for this long (stopped, frozen, cut off) ends the job;
    # one that dies ends it at once (jaxptd/runtime/peers.py); exit status 75
    heartbeat_timeout_s: int = 30
    collective_logs: bool = False  # show the collectives' (gloo's) connection messages
    # the hang watchdog (jaxptd/runtime/watchdog.py): a step that takes longer than this
    # many median step times ends the job (every thread's stack in <train.run_dir>/stacks/,
    # exit status 75 for a restart); 0: no watchdog
    watchdog_factor: float = 10.0
    watchdog_min_s: int = 120  # the step limit is never shorter than this
    # the limit of the start-up (restore, compile, the first step), of an evaluation and of
    # a checkpoint save
    watchdog_first_s: int = 1800
    # name a process whose host time a step (reading its batch rows, dispatching the step)
    # is this many times the median process's (jaxptd/runtime/stragglers.py); 0: never
    straggler_ratio: float = 1.5
    straggler_window: int = 5  # log steps a process must lag over (their median) to be named


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
        par = self.parallel
        return par.data * par.pipe * par.context * par.tensor

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
