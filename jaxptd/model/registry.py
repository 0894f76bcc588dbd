"""model.arch's model for the parts outside model/: `get`, its `Architecture` (the
interface of jaxptd/arch/interface.py, found through the registry jaxptd/arch: the family's
`load` imports jaxptd/model/<family>.py), and what the config alone asks of it: a batch
row's width, the rows it makes of the data's token rows, the ids it keeps for itself. So
nothing outside model/ branches on the architecture.
"""
from __future__ import annotations

import numpy as np

from jaxptd.arch import family
from jaxptd.arch.interface import Architecture
from jaxptd.config import ModelConfig


def get(cfg: ModelConfig) -> Architecture:
    """The architecture model.arch names."""
    return family(cfg).load()


def batch_width(cfg: ModelConfig) -> int:
    """Columns of a batch row: s + 1 tokens for decoders."""
    return get(cfg).batch_width(cfg)


def make_batch(tokens: np.ndarray, seed: int, step: int, first_row: int,
               cfg: ModelConfig) -> np.ndarray:
    """Token rows [n, s + 1] (rows first_row.. of batch `step`) -> the architecture's rows
    [n, batch_width] int32, a pure function of its arguments (numpy, on the host)."""
    return get(cfg).make_batch(tokens, seed, step, first_row, cfg)


def reserved_ids(cfg: ModelConfig) -> int:
    """Ids at the top of model.vocab_size the architecture keeps for itself (BERT's special
    tokens); the data's ids must stay below them."""
    return get(cfg).reserved_ids(cfg)
