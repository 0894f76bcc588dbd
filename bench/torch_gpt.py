"""The PyTorch baseline of bench/gpu_train.py: the same GPT, written as a PyTorch user would.

A nanoGPT-style model (one module file: pre-LN blocks, one fused QKV linear,
`F.scaled_dot_product_attention(is_causal=True)`, tanh GeLU, learned positions, the token
embedding tied to the output layer, the vocabulary padded to a multiple of 128 and not
masked) with jaxptd's initialisation (N(0, 0.02), residual outputs scaled by
1/sqrt(2 layers)), trained the way such a user trains: `torch.compile`, bf16 autocast
over float32 parameters, `torch.optim.AdamW(fused=True)` with weight decay on matrices
only, global-norm clipping, gradient accumulation over microbatches. On CUDA, attention
is restricted to the flash kernel, so a run that cannot use it fails instead of quietly
measuring another.

It reads jaxptd's own config (a YAML file and overrides, through jaxptd.config, which
does not import JAX), so layers, widths, sequence, vocabulary, global batch, microbatch
size, learning rate, betas, eps, weight decay and clipping are the same by construction.
The learning rate is held at optimizer.lr (the schedule does not change the cost).

    python -m bench.torch_gpt --config configs/gpu/gpt_1.3b.yaml \\
        train.global_batch=16 parallel.microbatches=4 [--steps 10] [--warmup 3]

Prints one line and, with --result FILE, writes the measurement as JSON (what
bench/gpu_train.py reads). model.attention, kernels and remat are jaxptd's options and
are ignored here: the baseline has flash attention and no recomputation.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxptd.config import Config, ConfigError, load_config

AUTOCAST = {"bfloat16": torch.bfloat16, "float32": None}


class CausalSelfAttention(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)

    def forward(self, x):  # x: [b, s, h]
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in (q, k, v))  # [b, heads, s, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))


class MLP(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.c_fc = nn.Linear(h, 4 * h)
        self.c_proj = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, h: int, heads: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(h, eps=eps)
        self.attn = CausalSelfAttention(h, heads)
        self.ln_2 = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(h)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        m = config.model
        vocab = m.padded_vocab(1)
        self.wte = nn.Embedding(vocab, m.hidden_size)
        self.wpe = nn.Embedding(m.seq_len, m.hidden_size)
        self.blocks = nn.ModuleList(Block(m.hidden_size, m.num_heads, m.layernorm_eps)
                                    for _ in range(m.num_layers))
        self.ln_f = nn.LayerNorm(m.hidden_size, eps=m.layernorm_eps)
        self.lm_head = nn.Linear(m.hidden_size, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual outputs, as jaxptd scales them
                nn.init.normal_(p, std=m.init_std / math.sqrt(2 * m.num_layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=m.init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):  # [b, s] each -> mean token loss
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [b, s, vocab]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model: nn.Module, config: Config, device: torch.device):
    """AdamW, decay on matrices (embeddings included, as jaxptd decays every 'w*' leaf)."""
    opt = config.optimizer
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                             fused=device.type == "cuda")


def train_step(model, optimizer, micro_tokens, config: Config, autocast):
    """One optimizer step: gradients accumulated over the microbatches [m, b, s + 1]."""
    for tokens in micro_tokens:
        with torch.autocast(tokens.device.type, dtype=autocast, enabled=autocast is not None):
            loss = model(tokens[:, :-1], tokens[:, 1:]) / len(micro_tokens)
        loss.backward()
    if config.optimizer.clip_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach() * len(micro_tokens)


def measure(config: Config, steps: int, warmup: int, compile_: bool) -> dict:
    """Median step time after `warmup` steps (the first compiles), each synchronised."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.train.seed)
    model = GPT(config).to(device)
    optimizer = make_optimizer(model, config, device)
    compiled = torch.compile(model) if compile_ else model
    m, s = config.parallel.microbatches, config.model.seq_len
    tokens = torch.randint(0, config.model.vocab_size, (m, config.microbatch_size, s + 1),
                           device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        losses.append(train_step(compiled, optimizer, tokens, config,
                                 AUTOCAST[config.model.dtype]))
        sync()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[warmup:])
    return {"tokens_per_s": config.train.global_batch * s / step_s, "step_time_s": step_s,
            "step_times_s": times[warmup:], "first_step_s": times[0],
            "params": sum(p.numel() for p in model.parameters()),
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda"
            else None,
            "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
            "compiled": compile_, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "microbatch_size": config.microbatch_size, "microbatches": m}


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="jaxptd YAML file")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile the model (auto: on CUDA only)")
    parser.add_argument("--result", help="write the measurement here as JSON")
    parser.error = _fail
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        _fail(str(e))
    if getattr(config.model, "arch", "gpt") != "gpt":
        _fail(f"model.arch={config.model.arch}: this baseline has the GPT only")
    if config.model.dtype not in AUTOCAST:
        _fail(f"model.dtype={config.model.dtype}: the baseline runs bfloat16 or float32")
    if args.steps <= 0 or args.warmup < 0:
        _fail(f"--steps {args.steps} --warmup {args.warmup}: need steps > 0, warmup >= 0")
    compile_ = args.compile == "on" or (args.compile == "auto" and torch.cuda.is_available())
    with (sdpa_kernel(SDPBackend.FLASH_ATTENTION) if torch.cuda.is_available()
          else contextlib.nullcontext()):  # on CUDA flash attention or an error
        result = measure(config, args.steps, args.warmup, compile_)
    print(f"torch {result['torch']} on {result['device']}: {result['tokens_per_s']:.0f} "
          f"tokens/s, step {result['step_time_s'] * 1e3:.1f} ms (compiled: {compile_})")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
