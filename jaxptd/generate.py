"""`python -m jaxptd.generate`: greedy and sampled decoding with a KV cache, from a jaxptd
checkpoint (`--checkpoint DIR`) or a Hugging Face directory (`--hf DIR`).

Owns decoding: the prompt fills the cache in one pass (the architecture's `decoder.decode`
over the whole prompt), then a `lax.scan` decodes one token at a time, all inside one
jitted `shard_map` over the mesh's tensor axis (`--tensor T`: the model's own Megatron
partitioning, the layer math of training). Each rank's [b, V/t] logits are assembled on
every rank by a psum of the zero-padded slices, so every rank draws the same token from
the same key.

Sampling: `--temperature 0` is greedy (argmax); otherwise logits / temperature, restricted
to the `--top-k` largest and then to the smallest set whose probability reaches `--top-p`,
drawn with `jax.random` from `--seed`. Prompts are text through the tokenizer the data was
prepared with (the checkpoint's data.path meta.json; a Hugging Face directory's
tokenizer.json; or `--tokenizer`), or `--prompt-ids 1,2,3`. Prints the text, then the
generated ids as a JSON list on the last line. Bad input: one `error:` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

from jaxptd.hf import bridge as hf
from jaxptd.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from jaxptd.data import DataError
from jaxptd.data.corpus import corpus_tokenizer
from jaxptd.data.tokenizer import load_tokenizer
from jaxptd.hf.names import HFError


def sample(logits, key, temperature: float, top_k: int, top_p: float):
    """Token ids [b] from logits [b, V] float32 (-inf where not allowed)."""
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        mass = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        # The smallest logit still needed to reach top_p (the first always stays).
        cutoff = jnp.take_along_axis(ordered, jnp.sum(mass < top_p, -1, keepdims=True), -1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def build(cfg: ModelConfig, mesh, vocab: int, prompt_len: int, new_tokens: int,
          temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """Jitted (params, prompt [b, P] int32, key) -> new ids [b, new_tokens] on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    # JAX and Flax on use: --help and bad arguments answer without starting them (~0.6 s)
    from jaxptd.parallel.mesh import TENSOR
    from jaxptd.model import get
    from jaxptd.model.tensor import Layout
    from jaxptd.model.vocab import vocab_start
    from jaxptd.parallel.sharding import RULES, specs_from_logical
    from jaxptd.parallel.varying import mark_varying

    arch, tensor = get(cfg), mesh.shape[TENSOR]
    decoder = arch.decoder
    layout = Layout(vocab, tensor, TENSOR)
    pick = partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)

    def full_logits(local):  # [b, V/t] -> [b, V], the same on every rank
        ids = vocab_start(layout) + jnp.arange(local.shape[-1])
        local = jnp.where(ids < cfg.vocab_size, local, -jnp.inf)
        placed = jnp.zeros((local.shape[0], vocab), local.dtype)
        placed = lax.dynamic_update_slice_in_dim(placed, jnp.where(
            jnp.isfinite(local), local, 0.0), vocab_start(layout), axis=1)
        return jnp.where(jnp.arange(vocab) < cfg.vocab_size, lax.psum(placed, TENSOR), -jnp.inf)

    def run(params, prompt, key):
        cache = decoder.init_cache(cfg, layout, prompt.shape[0], prompt_len + new_tokens)
        cache = mark_varying(cache, (TENSOR,))  # each rank's heads
        logits, cache = decoder.decode(params, prompt, cache, 0, cfg, layout)
        first = pick(full_logits(logits[:, -1]), jax.random.fold_in(key, 0))

        def step(carry, i):
            token, cache = carry
            logits, cache = decoder.decode(params, token[:, None], cache, prompt_len + i,
                                           cfg, layout)
            return (pick(full_logits(logits[:, 0]), jax.random.fold_in(key, i + 1)), cache), token

        (last, _), tokens = lax.scan(step, (first, cache), jnp.arange(new_tokens - 1))
        return jnp.concatenate([tokens.T, last[:, None]], axis=1)  # [b, new_tokens]

    # tensor parallelism only: every rank holds every expert of a mixture of experts (the
    # mesh's expert axis, of size 1, would type the experts varying over it)
    specs = specs_from_logical(arch.logical_axes(cfg, vocab, tensor), {**RULES, "experts": None})
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P()))


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m jaxptd.generate",
        description="Continues a prompt with a KV cache, greedy or sampled, from a jaxptd "
                    "checkpoint or a Hugging Face directory. Prints the text, then the new "
                    "token ids as a JSON list on the last line.",
        epilog="example: python -m jaxptd.generate --checkpoint runs/default --prompt 'def '"
               " --temperature 0")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a run, import or checkpoint dir")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the data's tokenizer")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizers JSON file (default: the "
                                            "one the data was prepared with)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: all tokens")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="the smallest set of tokens whose probability reaches it")
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel devices")
    args = parser.parse_args(argv)
    for ok, message in ((args.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
                        (args.temperature >= 0, "--temperature must be >= 0"),
                        (args.top_k >= 0, "--top-k must be >= 0"),
                        (0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
                        (args.tensor >= 1, "--tensor must be >= 1")):
        if not ok:
            raise ConfigError(message)
    return args


def _load(args):
    """(model config, global params, tokenizer spec or None) of --checkpoint or --hf."""
    if args.checkpoint:
        config, params, _ = hf.load_params(args.checkpoint, args.step)
        return config.model, params, args.tokenizer or corpus_tokenizer(config.data.path)
    _, model, params = hf.load_hf(args.hf)
    tokenizer = Path(args.hf, "tokenizer.json")
    return model, params, args.tokenizer or (str(tokenizer) if tokenizer.is_file() else None)


def _prompt_ids(args, tokenizer, vocab_size: int) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",")]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids!r}: expected integers like "
                              "1,2,3") from None
    elif tokenizer is None:
        raise ConfigError("--prompt: no tokenizer is known for this model (a Megatron "
                          "dataset or a Hugging Face directory without tokenizer.json); "
                          "pass --tokenizer or --prompt-ids")
    else:
        ids = tokenizer.encode(args.prompt.encode()).tolist()
    if not ids or min(ids) < 0 or max(ids) >= vocab_size:
        raise ConfigError(f"prompt ids {ids[:8]}...: need at least one id, each in "
                          f"[0, {vocab_size})")
    return ids


def main(argv=None) -> int:
    try:
        args = _parse(sys.argv[1:] if argv is None else argv)
        import jax  # after parsing: the CPU device count must be set before the backend
        if args.tensor > 1:
            jax.config.update("jax_num_cpu_devices", args.tensor)
        text, ids = generate(args)
    except (ConfigError, DataError, HFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if text is not None:
        print(text)
    print(json.dumps(ids))
    return 0


def generate(args) -> tuple[str | None, list[int]]:
    """(prompt + continuation as text when a tokenizer is known, the new ids)."""
    import jax
    import jax.numpy as jnp
    from jaxptd.parallel.mesh import make_mesh  # JAX and Flax on use, as in build
    from jaxptd.model import get

    model, params, spec = _load(args)
    decoder = get(model).decoder
    if decoder is None:
        raise ConfigError(f"model.arch={model.arch}: an encoder; generation needs a decoder")
    parallel = ParallelConfig(tensor=args.tensor)
    validate(Config(model=model, parallel=parallel))  # heads, kv heads, ffn vs --tensor
    if len(jax.devices()) < args.tensor:
        raise ConfigError(f"--tensor {args.tensor}: only {len(jax.devices())} devices")
    tokenizer = load_tokenizer(spec) if spec else None
    ids = _prompt_ids(args, tokenizer, model.vocab_size)
    limit = decoder.max_length(model)
    if limit and len(ids) + args.max_new_tokens > limit:
        raise ConfigError(f"prompt ({len(ids)} tokens) + --max-new-tokens "
                          f"{args.max_new_tokens} exceeds the model's {limit} positions")
    vocab = model.padded_vocab(args.tensor)
    mesh = make_mesh(parallel, jax.devices()[: args.tensor])
    run = build(model, mesh, vocab, len(ids), args.max_new_tokens, args.temperature,
                args.top_k, args.top_p)
    new = run(hf.pad_vocab(params, vocab), jnp.asarray([ids], jnp.int32),
              jax.random.key(args.seed))
    new = np.asarray(new)[0].tolist()
    return (tokenizer.decode(ids + new) if tokenizer else None), new


if __name__ == "__main__":
    sys.exit(main())
