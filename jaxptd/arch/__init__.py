"""The model families, JAX-free: what each declares (interface.py: `Family`, and the
`Architecture` its model is), one module per family (gpt.py, llama.py, bert.py: config
rules, options, Hugging Face map) and the registry that collects them (registry.py:
model.arch -> its Family). Re-exported here: the registry's tables and `family`.
"""
from jaxptd.arch.registry import FAMILIES, HF_CLASSES, PARTS, VOCAB_AXES, family

__all__ = ["FAMILIES", "HF_CLASSES", "PARTS", "VOCAB_AXES", "family"]
