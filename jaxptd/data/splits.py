"""How a corpus is split: the split names and the rule that cuts "val" off the end by tokens.

Shared by both on-disk formats: a jaxptd corpus (``corpus.py`` writes it, ``dataset.py``
reads it) and a Megatron-LM indexed dataset (``megatron.py``, which cuts by tokens when its
documents leave a split empty).
"""
from __future__ import annotations

import math

SPLITS = ("train", "val")


def val_tail(total: int, fraction: float) -> int:
    """Tokens at the end of a corpus of `total` (>= 2) that form a val split made by
    tokens: `fraction` of them rounded up, at least one, and at least one left to train."""
    return min(max(1, math.ceil(total * fraction)), total - 1)
