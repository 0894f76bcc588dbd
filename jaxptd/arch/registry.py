"""The architecture registry: model.arch -> its `Family` (jaxptd/arch/interface.py says
what a family declares), collected from the modules of jaxptd/arch/. The one place that
knows the families; nothing else branches on an architecture's name. JAX-free: config
validation and the Hugging Face bridge ask it before JAX may start, and a family's model
(`Family.load`, jaxptd/model/<name>.py) is imported only when asked for
(jaxptd.model.get).

A new family is two files: a module in jaxptd/arch/ defining `FAMILY` (its config rules,
options, what the JAX-free side reads of its model, Hugging Face map), found by
`_discover`, and its model in jaxptd/model/.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from typing import TYPE_CHECKING

from jaxptd.arch.interface import Family
from jaxptd.hf.names import HFClass

if TYPE_CHECKING:  # (not at run time: jaxptd/config/__init__.py runs rules.py, which asks this)
    from jaxptd.config.schema import ModelConfig

_PACKAGE = __name__.rpartition(".")[0]
_NOT_FAMILIES = ("interface", "registry")  # the types every family module imports; this


def _discover() -> dict[str, Family]:
    """model.arch -> Family of every module of jaxptd/arch/ that defines `FAMILY`, in
    module-name order (the order --help and the model.arch choices list them)."""
    families: dict[str, Family] = {}
    found = pkgutil.iter_modules([os.path.dirname(__file__)])
    for module in sorted(m.name for m in found if m.name not in _NOT_FAMILIES):
        declared = getattr(importlib.import_module(f"{_PACKAGE}.{module}"), "FAMILY", None)
        if declared is None:
            continue
        if declared.name in families:
            raise ImportError(f"jaxptd/arch/{module}.py: model.arch {declared.name!r} is "
                              "declared twice")
        families[declared.name] = declared
    return families


FAMILIES: dict[str, Family] = _discover()

# Every family's transformers classes: config.json's class name -> what import needs
HF_CLASSES: dict[str, HFClass] = {name: hf_class for f in FAMILIES.values()
                                  for name, hf_class in f.hf.classes.items()}
# Leaves kept as several transformers tensors -> the axis (of one layer's value) their parts
# stack on; ends leaves padded to the tensor multiple of the vocabulary -> their axis
PARTS: dict[str, int] = {k: v for f in FAMILIES.values() for k, v in f.hf.parts.items()}
VOCAB_AXES: dict[tuple, int] = {k: v for f in FAMILIES.values()
                                for k, v in f.hf.vocab_axes.items()}


def family(cfg: ModelConfig) -> Family:
    """The family model.arch names (config validation allows no other)."""
    return FAMILIES[cfg.arch]
