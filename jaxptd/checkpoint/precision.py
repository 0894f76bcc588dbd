"""Resuming across model.fp8=delayed: a checkpoint written with amax histories (model/fp8.py:
parameters of each layer linear, with their optimizer moments) restored into a run without
them, or the reverse. The checkpoint is read as it was written (the state of its own
precision, `restore_switching_fp8`) and then fitted to this run's state (`refit`):
histories the run has no use for are dropped, those the checkpoint lacks start as zeros
(the first step then scales by 1, as Transformer Engine starts)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxptd.checkpoint.checksums import leaf_name
from jaxptd.model import fp8


def _delayed(model: dict) -> bool:
    return model.get("fp8") == "delayed"


def restore_switching_fp8(restore_fn, setup, saved: dict | None):
    """restore_fn(abstract logical state) -> (state, ...) or None, read into the state the
    checkpoint holds: this run's, or where the saved config (`saved`, a to_dict()) and
    this run differ in using delayed scaling, the other precision's, then `refit`."""
    from jaxptd.train.state import StateLayout  # (the train state: on use)
    want = setup.state_layout.abstract_state(logical=True)
    was = (saved or {}).get("model", {})
    now = setup.config.model
    if saved is None or _delayed(was) == (now.fp8 == "delayed"):
        return restore_fn(want)
    model = dataclasses.replace(now, fp8=was.get("fp8", "none"),
                                fp8_history=was.get("fp8_history", now.fp8_history))
    config = dataclasses.replace(setup.config, model=model)
    layout = StateLayout(config, setup.mesh, setup.arch, setup.vocab)
    restored = restore_fn(layout.abstract_state(logical=True))
    return None if restored is None else (refit(restored[0], want), *restored[1:])


def refit(state, want):
    """`state` in the structure of `want` (ShapeDtypeStructs with shardings), leaf by leaf
    by path: the amax histories `want` has and `state` does not as zeros; the others
    must be in `state`."""
    have = {leaf_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}

    def one(path, like):
        name = leaf_name(path)
        if name in have:
            return have[name]
        assert fp8.is_history(path), name
        return jax.jit(lambda: jnp.zeros(like.shape, like.dtype), out_shardings=like.sharding)()
    return jax.tree_util.tree_map_with_path(one, want)
