"""The architecture registry: model.arch -> its `Family` (jaxptd/arch/interface.py says
what a family declares). The one place that lists the families; nothing else branches on an
architecture's name. JAX-free: config validation and the Hugging Face bridge ask it before
JAX may start, and a family's model (`Family.load`, jaxptd/model/<name>.py) is imported
only when asked for (jaxptd.model.get).

A new family is a module here (its config rules, options, Hugging Face map), its model in
jaxptd/model/, and its line below.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxptd.arch import bert, gpt, llama
from jaxptd.arch.interface import Family
from jaxptd.hf_names import HFClass

if TYPE_CHECKING:
    from jaxptd.config import ModelConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, llama.FAMILY, bert.FAMILY)}

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
