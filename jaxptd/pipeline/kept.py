"""A backward kept from one pipeline slot for a later one, as arrays (the executor's
parallel.stash=activations).

Owns `Kept`: which leaves of a `jax.vjp` backward are stored in the stash and how the
backward is rebuilt from them and what is passed in again: the chunk's weights, and a
zero-bubble F's dense() perturbations (zeros).
"""
import jax
import jax.numpy as jnp
from jax.tree_util import FlattenedIndexKey

# The path, in a jax.vjp backward, of the residuals that are its function's primals: JAX
# keeps a residual that is one of the primals as that primal, by argument and leaf (under
# the node's first child), apart from the residuals it computed (the second).
_PRIMALS = FlattenedIndexKey(0)


class Kept:
    """A `jax.vjp` backward kept from one slot for a later one, as arrays.

    The backward is a pytree: its leaves are the residuals (boolean and integer ones,
    attention and dropout masks, included) and its treedef the rest, so
    `jax.tree.unflatten(treedef, leaves)` is the backward again. It must be the vjp of a
    function whose first argument is a flat tuple of the chunk's weights; `arguments[k]`
    is argument k's flat tuple of leaves where it is passed in again (the weights, and a
    zero-bubble F's perturbations: zeros, which the layers' jax.checkpoint keeps as its
    inputs, gigabytes of them in the H100 compile of (2,2,2) zb-h1 SP with model.remat=
    minimal where they were stored), None where it is stored. Those leaves among the
    residuals are found by their place in that tree, (argument k, leaf j), not by
    comparing values. The probe (the first trace) fixes the treedef and which leaves are
    passed in again; every later backward must have the same tree and leaf types. That
    `jax.vjp`'s backward is a pytree of its residuals, to be carried, inspected and
    edited, is documented (JAX's "First-class VJPs"); where the weights sit in it is how
    jax 0.10.2 builds it, not a documented layout: the probe asserts it, so a JAX that
    lays it out otherwise fails at trace time rather than storing the weights. (Newer
    JAX's `jax.vjp(..., saveable_args=...)` leaves argument values such as weights out of
    the residuals directly: the way to go once the project's JAX has it.)
    """

    def __init__(self, backward, *arguments):
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(backward)
        given = {k for k, leaves in enumerate(arguments) if leaves is not None}
        # leaf index -> (k, j): leaf j of argument k, passed in again
        self.given = {i: (path[1].idx, path[2].idx) for i, (path, _) in enumerate(paths)
                      if path[0] == _PRIMALS and path[1].idx in given}
        assert any(k == 0 for k, _ in self.given.values()) and all(
            _aval(paths[i][1]) == _aval(arguments[k][j]) for i, (k, j) in self.given.items()), \
            "jax.vjp no longer keeps its arguments apart from the residuals it computed"
        self.templates = [jnp.zeros_like(x) for x in self._stored(backward)]

    def _stored(self, backward) -> list:
        leaves = jax.tree.leaves(backward)
        assert len(leaves) == self.treedef.num_leaves, "the backward differs from the probe's"
        return [x for i, x in enumerate(leaves) if i not in self.given]

    def keep(self, backward) -> list:
        """The residuals to store (every leaf but those passed in again), in buffer order."""
        kept = self._stored(backward)
        assert list(map(_aval, kept)) == list(map(_aval, self.templates)), \
            "the backward keeps different values than the probe's"
        return kept

    def run(self, cotangent, stored, *arguments):
        """The backward at `cotangent`, rebuilt from stored residuals and the arguments passed
        in again (as to the constructor: argument k's flat leaves, or None)."""
        stored = iter(stored)
        leaves = [arguments[self.given[i][0]][self.given[i][1]] if i in self.given
                  else next(stored) for i in range(self.treedef.num_leaves)]
        return jax.tree.unflatten(self.treedef, leaves)(cotangent)


def _aval(x):
    return x.shape, x.dtype
