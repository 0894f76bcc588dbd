"""How a family describes its map to a transformers checkpoint, as data (no I/O, no JAX;
jaxptd/hf/bridge.py and hf_files.py read and write the files, each family's map is its own:
jaxptd/arch/<family>.py, found through the registry jaxptd/arch/__init__.py).

Owns the vocabulary of those maps:

- `HFClass`: what import needs to know of one transformers class (its config.json ->
  jaxptd's model section, with a one-line `HFError` for what jaxptd cannot represent);
- `HFMap`: a family's classes, its config.json for export, and its tensor names:
  `names(m)`, a list of (HF name, jaxptd path, to jaxptd, to HF). An ends leaf has one HF
  name; a layer leaf (its path starts with 'layers') a tuple of names, one per element of
  the layer stack (a layer, or a unit's layer j: model.moe_every), stacked on its leading
  axis. A path ending in an int is one part of a leaf
  that transformers keeps as several tensors (k_proj and v_proj -> Llama's w_kv; BERT's
  query, key, value -> w_qkv), stacked on the leaf's axis `parts[name]` (of one layer's
  value). `extras(m)`: what a checkpoint may hold beside them, a tied copy (the name it
  must equal) or a buffer that is not a weight (None); `canonical`: the spellings
  transformers itself accepts on load, brought to one;
- the converters the maps are written with (`SAME`, `reshaped`, `linear`, `each_layer`,
  `gelu`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # (config/rules.py asks the registry, whose maps are written with this module)
    from jaxptd.config.schema import ModelConfig


class HFError(ValueError):
    """A user-caused problem with a Hugging Face directory or a checkpoint; one line."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise HFError(message)


@dataclass(frozen=True)
class HFClass:
    """What import needs to know of a transformers class."""
    config: Callable[[dict], dict]  # config.json -> jaxptd's model section
    tokens: dict = field(default_factory=dict)  # config key -> the token its id names
    absent: tuple = ()  # weights the class lacks: drawn as a fresh jaxptd model's


def _as_is(m: ModelConfig, tensors: dict) -> dict:
    return tensors


@dataclass(frozen=True)
class HFMap:
    """A family's bridge to transformers (module docstring)."""
    classes: dict[str, HFClass]  # transformers class name (config.json's architectures)
    export_config: Callable[[ModelConfig], dict]  # -> config.json
    names: Callable[[ModelConfig], list]  # (HF name(s), jaxptd path, to jaxptd, to HF)
    extras: Callable[[ModelConfig], dict]  # {HF name: the name it must equal, or None}
    parts: dict[str, int] = field(default_factory=dict)  # leaf -> axis its parts stack on
    vocab_axes: dict[tuple, int] = field(default_factory=dict)  # ends path -> padded axis
    canonical: Callable[[ModelConfig, dict], dict] = _as_is  # tensors under `names`' names


# --------------------------------------------------------------------------- converters

GELUS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> model.gelu


def gelu(hf: dict, key: str, default: str) -> str:
    """config.json's GeLU (`key`) as model.gelu."""
    act = hf.get(key, default)
    require(act in GELUS, f"{key}={act!r}: jaxptd's GeLU is gelu (exact) or gelu_new "
            "(tanh)")
    return GELUS[act]


SAME = (lambda x: x, lambda x: x)


def each_layer(pattern: str, m: ModelConfig, j: int = 0) -> tuple[str, ...]:
    """pattern's names of layer j of every unit of the layer stack, layers j, j + k, ...
    (k = m.unit; with one layer a unit, every layer), in the stack's order."""
    return tuple(pattern.format(i=i) for i in range(j, m.num_layers, m.unit))


def reshaped(shape, back):
    return lambda x: x.reshape(shape), lambda x: x.reshape(back)


def linear(shape, inputs: int = 1):
    """A torch Linear weight [out, in] <-> jaxptd's [*in, *out], whose leading `inputs`
    dims are torch's "in"."""
    rows, cols = int(np.prod(shape[:inputs])), int(np.prod(shape[inputs:]))
    return lambda x: x.T.reshape(shape), lambda x: x.reshape(rows, cols).T
