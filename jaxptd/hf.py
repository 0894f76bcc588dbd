"""`python -m jaxptd.hf import HF_DIR OUT_DIR` and `python -m jaxptd.hf export DIR HF_DIR
[--step N]`: the bridge to Hugging Face transformers checkpoints, through safetensors only.

Owns the name and shape mapping between a transformers model (GPT2LMHeadModel,
LlamaForCausalLM) and jaxptd's parameter tree, as data (`_gpt2_names`, `_llama_names`:
HF name -> (jaxptd path, to jaxptd, to HF)), and the two directions:

- import: config.json + *.safetensors -> OUT_DIR/config.yaml (the model section, run and
  checkpoint directories in OUT_DIR) and a real jaxptd checkpoint at step 0 in
  OUT_DIR/checkpoints (Checkpointer + Setup, the logical layout), so `python -m
  jaxptd.train --config OUT_DIR/config.yaml` fine-tunes from it at any layout. The
  optimizer state is AdamW's initial one (zero moments, step 0), as for any fresh run:
  transformers checkpoints carry no optimizer state.
- export: a checkpoint directory (OUT_DIR of import, a run directory or its checkpoints/;
  the newest step unless --step) -> config.json + model.safetensors that
  `transformers.AutoModelForCausalLM.from_pretrained` loads. The model config comes from
  the checkpoint's own layout record. Padded vocabulary rows are dropped.

Tensors are read and written as numpy arrays by `safetensors.numpy`; no pickle anywhere.
User errors (unsupported architecture, missing file, shape not matching the config) are
`HFError`: one `error:` line and exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from jaxptd.config import Config, ConfigError, ModelConfig, from_dict


class HFError(ValueError):
    """A user-caused problem with a Hugging Face directory or a checkpoint; one line."""


# --------------------------------------------------------------------------- configs

def _gpt2_config(hf: dict) -> dict:
    _require(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
             f"activation_function={hf.get('activation_function')!r}: jaxptd's GPT uses "
             "the tanh GeLU (gelu_new)")
    _require(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights",
                                                                      True),
             "attention scaling other than 1/sqrt(head_dim) is not supported")
    return {"arch": "gpt", "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"],
            "num_heads": hf["n_head"], "seq_len": hf["n_positions"],
            "vocab_size": hf["vocab_size"], "ffn_size": hf.get("n_inner") or 0,
            "layernorm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "dropout": hf.get("resid_pdrop", 0.1), "init_std": hf.get("initializer_range", 0.02)}


def _llama_config(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _require(rope.get("rope_type", rope.get("type", "default")) == "default",
             f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act must be silu")
    _require(not hf.get("attention_bias") and not hf.get("mlp_bias"),
             "attention or MLP biases are not supported")
    heads = hf["num_attention_heads"]
    _require(hf.get("head_dim") in (None, hf["hidden_size"] // heads),
             f"head_dim={hf.get('head_dim')} must be hidden_size / num_attention_heads")
    return {"arch": "llama", "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "seq_len": min(hf.get("max_position_embeddings", 2048), 2048),
            "vocab_size": hf["vocab_size"], "ffn_size": hf["intermediate_size"],
            "layernorm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "dropout": hf.get("attention_dropout", 0.0),
            "init_std": hf.get("initializer_range", 0.02)}


def _export_config(m: ModelConfig) -> dict:
    """config.json for transformers from a jaxptd model config."""
    if m.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": m.num_layers, "n_embd": m.hidden_size, "n_head": m.num_heads,
                "n_positions": m.seq_len, "vocab_size": m.vocab_size, "n_inner": m.ffn,
                "layer_norm_epsilon": m.layernorm_eps, "activation_function": "gelu_new",
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                "initializer_range": m.init_std, "tie_word_embeddings": True,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if m.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
                "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads,
                "head_dim": m.head_dim, "intermediate_size": m.ffn,
                "max_position_embeddings": m.seq_len, "vocab_size": m.vocab_size,
                "rms_norm_eps": m.layernorm_eps, "rope_theta": m.rope_theta,
                "hidden_act": "silu", "attention_dropout": m.dropout,
                "initializer_range": m.init_std, "tie_word_embeddings": False,
                "attention_bias": False, "mlp_bias": False,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    raise HFError(f"model.arch={m.arch!r}: export supports gpt (GPT2LMHeadModel) and llama "
                  "(LlamaForCausalLM)")


ARCHITECTURES = {"GPT2LMHeadModel": _gpt2_config, "LlamaForCausalLM": _llama_config}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise HFError(message)


# --------------------------------------------------------------------------- names

def _gpt2_names(m: ModelConfig) -> dict:
    """HF GPT-2 tensor name -> (jaxptd path, to jaxptd, to HF); {i}: the layer. Conv1D
    weights are stored [in, out]."""
    n, d, h = m.num_heads, m.head_dim, m.hidden_size
    same = (lambda x: x, lambda x: x)
    shaped = lambda shape, back: (lambda x: x.reshape(shape), lambda x: x.reshape(back))  # noqa: E731
    layer = "transformer.h.{i}."
    return {
        "transformer.wte.weight": (("embed", "wte"), *same),
        "transformer.wpe.weight": (("embed", "wpe"), *same),
        "transformer.ln_f.weight": (("final_norm", "scale"), *same),
        "transformer.ln_f.bias": (("final_norm", "bias"), *same),
        layer + "ln_1.weight": (("layers", "ln1", "scale"), *same),
        layer + "ln_1.bias": (("layers", "ln1", "bias"), *same),
        layer + "attn.c_attn.weight": (("layers", "attn", "w_qkv"), *shaped((h, 3, n, d), (h, 3 * h))),
        layer + "attn.c_attn.bias": (("layers", "attn", "b_qkv"), *shaped((3, n, d), (3 * h,))),
        layer + "attn.c_proj.weight": (("layers", "attn", "w_out"), *shaped((n, d, h), (h, h))),
        layer + "attn.c_proj.bias": (("layers", "attn", "b_out"), *same),
        layer + "ln_2.weight": (("layers", "ln2", "scale"), *same),
        layer + "ln_2.bias": (("layers", "ln2", "bias"), *same),
        layer + "mlp.c_fc.weight": (("layers", "mlp", "w_fc1"), *same),
        layer + "mlp.c_fc.bias": (("layers", "mlp", "b_fc1"), *same),
        layer + "mlp.c_proj.weight": (("layers", "mlp", "w_fc2"), *same),
        layer + "mlp.c_proj.bias": (("layers", "mlp", "b_fc2"), *same),
    }


def _llama_names(m: ModelConfig) -> dict:
    """HF Llama tensor name -> (jaxptd path, to jaxptd, to HF). torch Linear weights are
    stored [out, in]; k_proj and v_proj become the two halves of w_kv."""
    n, k, d, h = m.num_heads, m.kv_heads, m.head_dim, m.hidden_size
    same = (lambda x: x, lambda x: x)

    def linear(shape, inputs: int = 1):  # jaxptd's leading `inputs` dims are torch's "in"
        rows, cols = int(np.prod(shape[:inputs])), int(np.prod(shape[inputs:]))
        return lambda x: x.T.reshape(shape), lambda x: x.reshape(rows, cols).T

    layer = "model.layers.{i}."
    return {
        "model.embed_tokens.weight": (("embed", "wte"), *same),
        "model.norm.weight": (("final_norm", "scale"), *same),
        "lm_head.weight": (("head", "w_head"), lambda x: x.T, lambda x: x.T),
        layer + "input_layernorm.weight": (("layers", "ln1", "scale"), *same),
        layer + "post_attention_layernorm.weight": (("layers", "ln2", "scale"), *same),
        layer + "self_attn.q_proj.weight": (("layers", "attn", "w_q"), *linear((h, n, d))),
        layer + "self_attn.k_proj.weight": (("layers", "attn", "w_kv", 0), *linear((h, k, d))),
        layer + "self_attn.v_proj.weight": (("layers", "attn", "w_kv", 1), *linear((h, k, d))),
        layer + "self_attn.o_proj.weight": (("layers", "attn", "w_o"), *linear((n, d, h), 2)),
        layer + "mlp.gate_proj.weight": (("layers", "mlp", "w_gate"), *linear((h, m.ffn))),
        layer + "mlp.up_proj.weight": (("layers", "mlp", "w_up"), *linear((h, m.ffn))),
        layer + "mlp.down_proj.weight": (("layers", "mlp", "w_down"), *linear((m.ffn, h))),
    }


NAMES = {"gpt": _gpt2_names, "llama": _llama_names}


# --------------------------------------------------------------------------- import

def read_hf(hf_dir: str) -> tuple[str, dict, dict]:
    """(architecture, config.json dict, {name: numpy tensor}) of a transformers directory."""
    from safetensors.numpy import load_file

    config_path = Path(hf_dir, "config.json")
    _require(config_path.is_file(), f"{hf_dir}: no config.json (expected a transformers "
             "checkpoint directory: config.json and *.safetensors)")
    hf = json.loads(config_path.read_text())
    arch = (hf.get("architectures") or ["?"])[0]
    _require(arch in ARCHITECTURES, f"{config_path}: architecture {arch!r} is not supported "
             f"(supported: {', '.join(ARCHITECTURES)})")
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    _require(bool(files), f"{hf_dir}: no *.safetensors files (pickled checkpoints are not "
             "read; save with safe_serialization=True)")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return arch, hf, tensors


VOCAB_AXES = {("embed", "wte"): 0, ("head", "w_head"): 1}  # padded to the tensor multiple


def to_params(model: ModelConfig, tensors: dict, vocab: int) -> dict:
    """HF tensors -> jaxptd's global parameter tree (float32, vocabulary padded to `vocab`).
    Every tensor's shape is checked against the config first."""
    if model.arch == "gpt":  # GPT2Model checkpoints have no "transformer." prefix
        tensors = {n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": v
                   for n, v in tensors.items()}
    if model.arch == "llama" and "lm_head.weight" not in tensors:  # tied embeddings
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    shapes = _layer_shapes(model)
    params: dict = {}
    halves: dict = {}  # w_kv's path -> {0: keys, 1: values}
    for name, (path, to_jax, to_hf) in NAMES[model.arch](model).items():
        want = to_hf(np.zeros(shapes[path])).shape
        values = []
        for i in range(model.num_layers) if "{i}" in name else [None]:
            hf_name = name.format(i=i)
            _require(tensors.get(hf_name) is not None,
                     f"tensor {hf_name!r} is missing from the safetensors files")
            have = tuple(tensors[hf_name].shape)
            _require(have == want, f"tensor {hf_name!r} has shape {have}, the config needs "
                     f"{want}")
            values.append(to_jax(np.asarray(tensors[hf_name], np.float32)))
        value = np.stack(values) if "{i}" in name else values[0]
        if isinstance(path[-1], int):
            halves.setdefault(path[:-1], {})[path[-1]] = value
        else:
            _set(params, path, value)
    for path, parts in halves.items():  # [L, h, k, d] x 2 -> [L, h, 2, k, d]
        _set(params, path, np.stack([parts[0], parts[1]], axis=2))
    return pad_vocab(params, vocab)


def pad_vocab(params: dict, vocab: int) -> dict:
    """Zero rows (columns of the output layer) up to the padded vocabulary `vocab`."""
    for (section, leaf), axis in VOCAB_AXES.items():
        if section in params:
            table = np.asarray(params[section][leaf])
            widths = [(0, 0)] * table.ndim
            widths[axis] = (0, vocab - table.shape[axis])
            params[section][leaf] = np.pad(table, widths)
    return params


def _layer_shapes(model: ModelConfig) -> dict:
    """jaxptd path -> the shape of one HF tensor's jaxptd value (one layer's for layer
    leaves, one half of w_kv for the paths ending in its index), unpadded vocabulary."""
    import jax
    from jaxptd.model import get

    abstract = jax.eval_shape(lambda: get(model).init_params(model, model.vocab_size,
                                                             jax.random.key(0)))
    shapes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        keys = tuple(p.key for p in path)
        shape = leaf.shape[1:] if keys[0] == "layers" else leaf.shape
        shapes[keys] = shape
        if keys[-1] == "w_kv":
            shapes[keys + (0,)] = shapes[keys + (1,)] = shape[:1] + shape[2:]
    return shapes


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def from_params(model: ModelConfig, params: dict) -> dict:
    """jaxptd's global parameters -> {HF name: float32 numpy tensor} (padding dropped)."""
    tensors = {}
    for name, (path, _, to_hf) in NAMES[model.arch](model).items():
        keys = [k for k in path if not isinstance(k, int)]
        value = params
        for key in keys:
            value = value[key]
        value = np.asarray(value, np.float32)
        if tuple(keys) in VOCAB_AXES:
            value = np.take(value, np.arange(model.vocab_size), axis=VOCAB_AXES[tuple(keys)])
        if isinstance(path[-1], int):
            value = value[:, :, path[-1]]  # [L, h, 2, k, d] -> half [L, h, k, d]
        if "{i}" in name:
            tensors.update({name.format(i=i): np.ascontiguousarray(to_hf(v))
                            for i, v in enumerate(value)})
        else:
            tensors[name] = np.ascontiguousarray(to_hf(value))
    return tensors


def load_hf(hf_dir: str) -> tuple[dict, ModelConfig, dict]:
    """(jaxptd config tree, its model config, global params padded for tensor = 1)."""
    arch, hf, tensors = read_hf(hf_dir)
    tree = {"model": ARCHITECTURES[arch](hf)}
    try:
        model = from_dict(tree).model
    except ConfigError as e:
        raise HFError(f"{hf_dir}/config.json gives an invalid jaxptd config: {e}") from None
    return tree, model, to_params(model, tensors, model.padded_vocab(1))


def import_hf(hf_dir: str, out_dir: str) -> Path:
    """Writes OUT_DIR/config.yaml and a step-0 checkpoint; returns the config path."""
    import yaml

    tree, _, params = load_hf(hf_dir)
    out = Path(out_dir).absolute()
    tree.update({"train": {"run_dir": str(out)}, "checkpoint": {"dir": str(out / "checkpoints")}})
    setup = _single_device_setup(from_dict(tree))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(
        f"# Imported from {Path(hf_dir).absolute()} by python -m jaxptd.hf import\n"
        + yaml.safe_dump(tree, sort_keys=False))
    _save(setup, params)
    return out / "config.yaml"


def _single_device_setup(config: Config):
    """Setup on one device (data = pipe = tensor = 1, no ZeRO-1): the logical layout."""
    import jax
    from jaxptd.config import ParallelConfig
    from jaxptd.mesh import make_mesh
    from jaxptd.step import Setup

    config = dataclasses.replace(
        config, parallel=ParallelConfig(),
        optimizer=dataclasses.replace(config.optimizer, zero1=False),
        runtime=dataclasses.replace(config.runtime, cpu_devices=0, num_processes=0,
                                    process_id=-1))
    return Setup(config, make_mesh(config.parallel, jax.devices()[:1]))


def _save(setup, params) -> None:
    """A step-0 checkpoint: `params`, AdamW's initial state, the run's seed."""
    import jax
    from jaxptd.checkpoint import Checkpointer, layout_metadata

    config = setup.config
    state = setup.init_state(config.train.seed)
    state["params"] = jax.device_put(params, setup.state_shardings["params"])
    ckpt = Checkpointer(config.checkpoint_dir, every=1, keep=1, async_save=False,
                        metadata=layout_metadata(config, 1))
    ckpt.save(0, setup.state_to_logical(state))
    ckpt.close()


def checkpoint_steps(directory: str) -> tuple[Path, list[int]]:
    """(checkpoint directory, its complete steps) for a run, import or checkpoint directory."""
    for candidate in (Path(directory, "checkpoints"), Path(directory)):
        steps = sorted(int(p.name) for p in candidate.glob("*")
                       if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())
        if steps:
            return candidate, steps
    raise HFError(f"{directory}: no complete checkpoint steps (expected the directory "
                  "`import` wrote, a run directory or its checkpoints/)")


def load_params(directory: str, step: int | None = None):
    """(config, global float32 params as numpy (vocabulary padded for tensor = 1), step)
    from a checkpoint directory."""
    import jax
    from jaxptd.checkpoint import Checkpointer

    ckpt_dir, steps = checkpoint_steps(directory)
    step = steps[-1] if step is None else step
    _require(step in steps, f"--step {step}: not among the complete steps {steps} of "
             f"{ckpt_dir}")
    record = json.loads((ckpt_dir / str(step) / "layout" / "metadata").read_text())
    config = from_dict(record["config"])
    setup = _single_device_setup(config)
    ckpt = Checkpointer(str(ckpt_dir), every=0, keep=len(steps), async_save=False)
    state = ckpt.restore(setup.abstract_state(logical=True), step, config.model.vocab_size)
    ckpt.close()
    return config, jax.device_get(state["params"]), step


def export_hf(directory: str, hf_dir: str, step: int | None = None) -> int:
    """config.json + model.safetensors in HF_DIR from a checkpoint; returns the step."""
    from safetensors.numpy import save_file

    config, params, step = load_params(directory, step)
    model = config.model
    hf_config = _export_config(model)
    out = Path(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(from_params(model, params), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxptd.hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a transformers directory -> a jaxptd checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    exp = sub.add_parser("export", help="a jaxptd checkpoint -> a transformers directory")
    exp.add_argument("directory")
    exp.add_argument("hf_dir")
    exp.add_argument("--step", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            path = import_hf(args.hf_dir, args.out_dir)
            print(f"imported {args.hf_dir} -> {path} (checkpoint step 0); train with "
                  f"python -m jaxptd.train --config {path}")
        else:
            step = export_hf(args.directory, args.hf_dir, args.step)
            print(f"exported step {step} of {args.directory} -> {args.hf_dir}")
    except (HFError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
