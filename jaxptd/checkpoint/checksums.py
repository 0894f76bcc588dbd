"""The arrays' checksums: what a step records of its arrays and how restore checks them.

Owns `checksums` in the layout item: per array, the uint32 sum of its bit patterns,
computed on the devices from the state being saved (no extra I/O). A byte flipped inside
array data that Orbax and tensorstore read without complaint (they do not checksum array
chunks) changes the sum, so restore refuses the step (store.py sets it aside). Leaves are
named by `leaf_name`, the same for a dict and a NamedTuple holding them, so a restored
tree of another container type still matches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P


def leaf_name(path) -> str:
    """A leaf's path as 'a/b/c', the same for a dict and a NamedTuple holding it."""
    return "/".join(str(getattr(e, "key", getattr(e, "name", getattr(e, "idx", e))))
                    for e in path)


def _bits(x):
    """x's bit patterns as uint32 (wider types as several words)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, width).astype(jnp.uint32)


@functools.lru_cache(maxsize=8)
def _sums_fn(mesh):
    """The jitted per-leaf sums, replicated over `mesh` (one compile per mesh and tree)."""
    return jax.jit(lambda xs: [jnp.sum(_bits(x), dtype=jnp.uint32) for x in xs],
                   out_shardings=NamedSharding(mesh, P()))


def array_checksums(tree) -> dict[str, int]:
    """{leaf name: uint32 sum of the leaf's bit patterns} for a pytree of global arrays.

    A collective (every process must call it); the sum is exact integer arithmetic, so it
    does not depend on the layout or the process count the arrays are sharded over.
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = _sums_fn(leaves[0][1].sharding.mesh)([x for _, x in leaves])
    return {leaf_name(path): int(s) for (path, _), s in zip(leaves, jax.device_get(sums))}


def checksum_mismatch(tree, expected: dict | None) -> str | None:
    """The first leaf of `tree` whose checksum differs from `expected` (None: all agree or
    no checksums recorded)."""
    if not expected:
        return None
    for name, value in array_checksums(tree).items():
        if name in expected and expected[name] != value:
            return f"array {name}: data does not match its checksum"
    return None
