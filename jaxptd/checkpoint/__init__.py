"""Checkpoints: the train state on disk (Orbax only), how it is trusted, how it comes back.

A checkpoint directory (`checkpoint.dir`) holds one directory per saved step, named by
the step. A step directory holds two Orbax items: `state` (the train state in the logical
layout, OCDBT, each process writing only its own shards) and `layout` (JSON: data, pipe,
tensor, chunks, zero1, processes, padded_vocab, the whole config it was written with and
the arrays' checksums), and `files.json`, the list of its files. A save in progress is a
`<step>.orbax-checkpoint-tmp-*` directory; a step restore found damaged is moved aside to
`<step>.corrupt`.

The modules, lightest first (importing this package or files, integrity or __main__ loads
neither JAX nor Orbax, so `python -m jaxptd.hf --help` and `python -m jaxptd.checkpoint
inspect` start in a fraction of a second):

- `files.py`: the directory on disk: where a run's checkpoints are, which steps are
  complete, each step's file list and layout item, whether the directory is writable;
- `integrity.py`: the cheap checks of a step and the per-step records `inspect` lists;
- `checksums.py`: the arrays' checksums (JAX);
- `store.py`: `Checkpointer`, Orbax's save and restore into any layout (JAX, Orbax);
- `__main__.py`: `python -m jaxptd.checkpoint inspect DIR`.

- `errors.py`: `CheckpointError`, the one error every part raises, and its kind
  `ModelMismatch`, which a caller that knows the configs turns into the keys that changed.
"""
from jaxptd.checkpoint.errors import CheckpointError, ModelMismatch

__all__ = ["CheckpointError", "ModelMismatch"]

