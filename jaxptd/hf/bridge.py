"""`python -m jaxptd.hf import HF_DIR OUT_DIR` and `python -m jaxptd.hf export DIR HF_DIR
[--step N]`: the bridge to Hugging Face transformers checkpoints, through safetensors only.

Owns the two directions between a transformers directory (GPT2LMHeadModel,
LlamaForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM,
BertForPreTraining and BertForMaskedLM, their MegatronBert forms) and
jaxptd's checkpoints; what maps to what is each family's data (jaxptd/arch/<family>.py,
found through the registry jaxptd/arch), the files and their failures are
jaxptd/hf/files.py's:

- import: config.json + *.safetensors -> OUT_DIR/config.yaml (the model section, run and
  checkpoint directories in OUT_DIR) and a real jaxptd checkpoint at step 0 in
  OUT_DIR/checkpoints (Checkpointer + Setup, the logical layout), so `python -m
  jaxptd.train --config OUT_DIR/config.yaml` fine-tunes from it at any layout. The
  optimizer state is AdamW's initial one (zero moments, step 0), as for any fresh run:
  transformers checkpoints carry no optimizer state.
  A class without some of jaxptd's weights (BertForMaskedLM: no pooler, no sentence
  head) gets them as a fresh model draws them, with a note.
- export: a checkpoint directory (OUT_DIR of import, a run directory or its checkpoints/;
  the newest step unless --step) -> config.json + model.safetensors that transformers'
  `AutoModelForCausalLM` (GPT; a llama as the one of its four classes that holds it) or
  `AutoModelForPreTraining` (BERT: post-LN as BertForPreTraining, pre-LN as
  MegatronBertForPreTraining) loads. The model config comes
  from the checkpoint's own layout record. Padded vocabulary rows are dropped.

Both refuse an output directory that holds anything unless given --overwrite, which
replaces all of it, and write it whole or not at all. Every tensor of the input is
accounted for. Tensors are read and written as numpy arrays by `safetensors.numpy`; no
pickle anywhere. User errors (unsupported architecture, unreadable or missing files,
tensors the config does not describe, an unwritable output) are `HFError`: one `error:`
line and exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import numpy as np

from jaxptd.arch import HF_CLASSES, PARTS, VOCAB_AXES, family
from jaxptd.checkpoint import CheckpointError
from jaxptd.checkpoint.files import (complete_steps, find_checkpoints, layout_metadata,
                                     read_layout)
from jaxptd.config import Config, ConfigError, ModelConfig, ParallelConfig, from_dict
from jaxptd.hf.files import check_target, publish, read_hf
from jaxptd.hf.names import HFError, require
from jaxptd.runtime.runlog import STARTS


# --------------------------------------------------------------------------- import

def to_params(model: ModelConfig, tensors: dict, vocab: int) -> dict:
    """HF tensors -> jaxptd's global parameter tree (float32, vocabulary padded to `vocab`).
    Every tensor is accounted for (_expected) and its shape checked against the config."""
    tensors = _expected(model, family(model).hf.canonical(model, tensors))
    shapes = _layer_shapes(model)
    params: dict = {}
    parts: dict = {}  # a leaf's path -> {part index: value}
    for hf_names, path, to_jax, to_hf in family(model).hf.names(model):
        want = to_hf(np.zeros(shapes[path])).shape
        values = []
        for hf_name in (hf_names,) if isinstance(hf_names, str) else hf_names:
            have = tuple(tensors[hf_name].shape)
            require(have == want, f"tensor {hf_name!r} has shape {have}, the config needs "
                    f"{want}")
            values.append(to_jax(np.asarray(tensors[hf_name], np.float32)))
        value = values[0] if isinstance(hf_names, str) else np.stack(values)
        if isinstance(path[-1], int):
            parts.setdefault(path[:-1], {})[path[-1]] = value
        else:
            _set(params, path, value)
    for path, values in parts.items():  # e.g. [L, h, k, d] x 2 -> w_kv [L, h, 2, k, d]
        axis = PARTS[path[-1]] + (path[0] == "layers")
        _set(params, path, np.stack([values[i] for i in sorted(values)], axis=axis))
    return pad_vocab(params, vocab)


def _expected(model: ModelConfig, tensors: dict) -> dict:
    """`tensors` less the tied copies and buffers (the family's `extras`), once every tensor
    is one the config expects and every expected one is there."""
    hf_map = family(model).hf
    extras = hf_map.extras(model)
    for name, tied in extras.items():
        if name in tensors and tied is not None and tied in tensors:
            require(np.array_equal(tensors[name], tensors[tied]), f"tensor {name!r} differs "
                    f"from {tied!r}: jaxptd's {model.arch} ties them (one weight)")
    tensors = {k: v for k, v in tensors.items() if k not in extras}
    expected = {name for entry in hf_map.names(model) for name in
                ((entry[0],) if isinstance(entry[0], str) else entry[0])}
    model_name = f"the {model.num_layers}-layer {model.arch} that config.json describes"
    for found, problem in ((set(tensors) - expected, f"hold tensors {model_name} does not "
                            "have"), (expected - set(tensors), f"lack tensors of {model_name}")):
        listed = sorted(found)
        require(not found, f"the safetensors files {problem}: {', '.join(listed[:4])}"
                f"{f' and {len(listed) - 4} more' if len(listed) > 4 else ''}")
    return tensors


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
    leaves, one part's for the paths ending in its index), unpadded vocabulary."""
    import jax
    from jaxptd.model import get  # JAX, Flax: ~0.6 s that --help and import's checks skip

    abstract = jax.eval_shape(lambda: get(model).init_params(model, model.vocab_size,
                                                             jax.random.key(0)))
    shapes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        keys = tuple(p.key for p in path)
        shape = leaf.shape[1:] if keys[0] == "layers" else leaf.shape
        shapes[keys] = shape
        if keys[-1] in PARTS:
            axis = PARTS[keys[-1]]
            for i in range(shape[axis]):
                shapes[keys + (i,)] = shape[:axis] + shape[axis + 1:]
    return shapes


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def from_params(model: ModelConfig, params: dict) -> dict:
    """jaxptd's global parameters -> {HF name: float32 numpy tensor} (padding dropped)."""
    tensors = {}
    for hf_names, path, _, to_hf in family(model).hf.names(model):
        keys = [k for k in path if not isinstance(k, int)]
        value = params
        for key in keys:
            value = value[key]
        value = np.asarray(value, np.float32)
        if tuple(keys) in VOCAB_AXES:
            value = np.take(value, np.arange(model.vocab_size), axis=VOCAB_AXES[tuple(keys)])
        if isinstance(path[-1], int):  # one part, e.g. w_kv [L, h, 2, k, d] -> [L, h, k, d]
            value = np.take(value, path[-1], axis=PARTS[path[-2]] + (path[0] == "layers"))
        if isinstance(hf_names, str):
            tensors[hf_names] = np.ascontiguousarray(to_hf(value))
        else:
            tensors.update({name: np.ascontiguousarray(to_hf(v))
                            for name, v in zip(hf_names, value)})
    return tensors


def load_hf(hf_dir: str) -> tuple[dict, ModelConfig, dict]:
    """(jaxptd config tree, its model config, global params padded for tensor = 1)."""
    arch, hf, tensors = read_hf(hf_dir)
    hf_class = HF_CLASSES[arch]
    try:
        tree = {"model": hf_class.config(hf)}
    except KeyError as e:
        raise HFError(f"{hf_dir}/config.json has no {e.args[0]!r}, which {arch} needs") from None
    except TypeError as e:
        raise HFError(f"{hf_dir}/config.json: a setting of the wrong type ({e})") from None
    try:
        model = from_dict(tree).model
    except ConfigError as e:
        raise HFError(f"{hf_dir}/config.json gives an invalid jaxptd config: {e}") from None
    absent = tuple(name for name in hf_class.absent if name not in tensors)
    if absent:
        tensors = {**tensors, **_fresh(model, absent)}
        print(f"note: {arch} has no {', '.join(absent)}: drawn as a fresh jaxptd "
              f"{model.arch} draws them", file=sys.stderr)
    return tree, model, to_params(model, tensors, model.padded_vocab(1))


def _fresh(model: ModelConfig, hf_names: tuple) -> dict:
    """{HF name: a fresh model's value} (jaxptd's initialisation, seed 0) of `hf_names`."""
    import jax
    from jaxptd.model import get  # JAX, Flax: ~0.6 s that --help and import's checks skip

    params = get(model).init_params(model, model.padded_vocab(1), jax.random.key(0))
    return {name: value for name, value in from_params(model, jax.device_get(params)).items()
            if name in hf_names}


def import_hf(hf_dir: str, out_dir: str, overwrite: bool = False) -> Path:
    """Writes OUT_DIR/config.yaml (and its record starts/import.yaml) and a step-0
    checkpoint; returns the config path."""
    import yaml

    out = Path(out_dir).absolute()
    check_target(out, overwrite, Path(hf_dir))
    tree, _, params = load_hf(hf_dir)
    tree.update({"train": {"run_dir": str(out)}, "checkpoint": {"dir": str(out / "checkpoints")}})
    setup = _single_device_setup(from_dict(tree))

    text = (f"# Imported from {Path(hf_dir).absolute()} by python -m jaxptd.hf import\n"
            + yaml.safe_dump(tree, sort_keys=False))

    def write(directory: Path) -> None:  # the config names `out`, where it will be
        (directory / "config.yaml").write_text(text)  # a fine-tune's start replaces it,
        (directory / STARTS).mkdir()  # the record of the import stays
        (directory / STARTS / "import.yaml").write_text(text)
        _save(setup, params, directory / "checkpoints")

    publish(out, write)
    return out / "config.yaml"


def _single_device_setup(config: Config):
    """Setup on one device (data = pipe = tensor = 1, no ZeRO-1): the logical layout."""
    import jax
    from jaxptd.parallel.mesh import make_mesh  # JAX, Flax, optax: on use, as in _layer_shapes
    from jaxptd.train.step import Setup

    config = dataclasses.replace(
        config, parallel=ParallelConfig(),
        optimizer=dataclasses.replace(config.optimizer, zero1=False),
        runtime=dataclasses.replace(config.runtime, cpu_devices=0, num_processes=0,
                                    process_id=-1))
    return Setup(config, make_mesh(config.parallel, jax.devices()[:1]))


def _save(setup, params, directory: Path) -> None:
    """A step-0 checkpoint in `directory`: `params`, AdamW's initial state, the run's seed."""
    import jax
    from jaxptd.checkpoint.store import Checkpointer  # Orbax: on use, not at start-up

    config = setup.config
    state = setup.state_layout.init_state(config.train.seed)
    state["params"] = jax.device_put(params, setup.state_layout.state_shardings["params"])
    ckpt = Checkpointer(str(directory), every=1, keep=1, async_save=False,
                        metadata=layout_metadata(config, 1))
    ckpt.save(0, setup.state_layout.state_to_logical(state))
    ckpt.close()


def checkpoint_steps(directory: str) -> tuple[Path, list[int]]:
    """(checkpoint directory, its complete steps) for a run, import, checkpoint or step
    directory (found as `python -m jaxptd.checkpoint inspect` finds it)."""
    require(Path(directory).exists(), f"{directory}: no such file or directory (give the "
            "directory `import` wrote, a run directory, its checkpoints/ or one step)")
    found = find_checkpoints(str(directory))
    steps = complete_steps(found) if found else []
    if steps:
        return Path(found), steps
    raise HFError(f"{directory}: no complete checkpoint steps (expected the directory "
                  "`import` wrote, a run directory or its checkpoints/)")


def load_params(directory: str, step: int | None = None):
    """(config, global float32 params as numpy (vocabulary padded for tensor = 1), step)
    from a checkpoint directory."""
    import jax
    from jaxptd.checkpoint.store import Checkpointer  # Orbax: on use, not at start-up

    ckpt_dir, steps = checkpoint_steps(directory)
    step = steps[-1] if step is None else step
    require(step in steps, f"--step {step}: not among the complete steps {steps} of "
            f"{ckpt_dir}")
    record = read_layout(str(ckpt_dir / str(step)))
    require(record is not None, f"{ckpt_dir / str(step)}: its layout record "
            "(layout/metadata) is unreadable")
    config = from_dict(record["config"])
    setup = _single_device_setup(config)
    ckpt = Checkpointer(str(ckpt_dir), every=0, keep=len(steps), async_save=False)
    state = ckpt.restore(setup.state_layout.abstract_state(logical=True), step,
                         config.model.vocab_size)
    ckpt.close()
    return config, jax.device_get(state["params"]), step


def export_hf(directory: str, hf_dir: str, step: int | None = None,
              overwrite: bool = False) -> int:
    """config.json + model.safetensors in HF_DIR from a checkpoint; returns the step."""
    from safetensors.numpy import save_file

    out = Path(hf_dir).absolute()
    check_target(out, overwrite, Path(directory))
    config, params, step = load_params(directory, step)
    hf_config = family(config.model).hf.export_config(config.model)

    def write(target: Path) -> None:
        save_file(from_params(config.model, params), str(target / "model.safetensors"),
                  metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps(hf_config, indent=2))

    publish(out, write)
    return step


HELP_EPILOG = f"""examples:
  python -m jaxptd.hf import HF_DIR OUT_DIR   # fine-tune it:
  python -m jaxptd.train --config OUT_DIR/config.yaml
  python -m jaxptd.hf export RUN_DIR HF_DIR   # the newest step; --step N for another

{textwrap.fill('classes: ' + ', '.join(sorted(HF_CLASSES)), 90)}
Both refuse a non-empty output directory unless --overwrite, and write it whole or not at
all; export drops the padded vocabulary rows and writes float32 safetensors."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxptd.hf", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Converts between Hugging Face transformers checkpoints (safetensors) "
                    "and jaxptd checkpoints.", epilog=HELP_EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a transformers directory -> a jaxptd checkpoint")
    imp.add_argument("hf_dir", help="config.json and *.safetensors (save_pretrained's)")
    imp.add_argument("out_dir", help="new directory: config.yaml and checkpoints/ (step 0)")
    exp = sub.add_parser("export", help="a jaxptd checkpoint -> a transformers directory")
    exp.add_argument("directory", help="an import's or run's directory, its checkpoints/ "
                                       "or one step")
    exp.add_argument("hf_dir")
    exp.add_argument("--step", type=int)
    for command in (imp, exp):
        command.add_argument("--overwrite", action="store_true",
                             help="replace everything in a non-empty output directory")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            path = import_hf(args.hf_dir, args.out_dir, args.overwrite)
            print(f"imported {args.hf_dir} -> {path} (checkpoint step 0); train with "
                  f"python -m jaxptd.train --config {path}")
        else:
            step = export_hf(args.directory, args.hf_dir, args.step, args.overwrite)
            print(f"exported step {step} of {args.directory} -> {args.hf_dir}")
    except (HFError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
