"""A backward kept from one pipeline slot for a later one, as arrays (the executor's
parallel.stash=activations).

Owns `Kept`: which leaves of a `jax.vjp` backward are stored in the stash and how the
backward is rebuilt from them and the chunk's weights, passed in again.
"""
import jax
import jax.numpy as jnp
from jax.tree_util import FlattenedIndexKey, SequenceKey

# The path, in a jax.vjp backward, of the residuals that are its function's first argument:
# JAX keeps a residual that is one of the primals as that primal, by argument and leaf
# (the node's first child), apart from the residuals it computed (the second).
_FIRST_ARGUMENT = (FlattenedIndexKey(0), SequenceKey(0))


class Kept:
    """A `jax.vjp` backward kept from one slot for a later one, as arrays.

    The backward is a pytree: its leaves are the residuals (boolean and integer ones,
    attention and dropout masks, included) and its treedef the rest, so
    `jax.tree.unflatten(treedef, leaves)` is the backward again. It must be the vjp of a
    function whose first argument is a flat tuple of the chunk's weights (`weights`): the
    weights among its residuals are found by their place in that tree, (first argument,
    leaf j), not by comparing values, and are passed in again rather than stored. The
    probe (the first trace) fixes the treedef and which leaves are weights; every later
    backward must have the same tree and leaf types. That `jax.vjp`'s backward is a pytree
    of its residuals, to be carried, inspected and edited, is documented (JAX's "First-class
    VJPs"); where the weights sit in it is how jax 0.10.2 builds it, not a documented layout:
    the probe asserts it, so a JAX that lays it out otherwise fails at trace time rather
    than storing the weights. (Newer JAX's `jax.vjp(..., saveable_args=...)` leaves argument
    values such as weights out of the residuals directly: the way to go once the project's
    JAX has it.)
    """

    def __init__(self, backward, weights):
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(backward)
        # leaf index -> index j of the weight it is
        self.weights = {i: path[2].idx for i, (path, _) in enumerate(paths)
                        if path[:2] == _FIRST_ARGUMENT}
        assert self.weights and all(
            _aval(paths[i][1]) == _aval(weights[j]) for i, j in self.weights.items()), \
            "jax.vjp no longer keeps its arguments apart from the residuals it computed"
        self.templates = [jnp.zeros_like(x) for x in self._stored(backward)]

    def _stored(self, backward) -> list:
        leaves = jax.tree.leaves(backward)
        assert len(leaves) == self.treedef.num_leaves, "the backward differs from the probe's"
        return [x for i, x in enumerate(leaves) if i not in self.weights]

    def keep(self, backward) -> list:
        """The residuals to store (every leaf but the weights), in buffer order."""
        kept = self._stored(backward)
        assert list(map(_aval, kept)) == list(map(_aval, self.templates)), \
            "the backward keeps different values than the probe's"
        return kept

    def run(self, cotangent, stored, weights):
        """The backward at `cotangent`, rebuilt from stored residuals and the weights."""
        stored = iter(stored)
        leaves = [weights[self.weights[i]] if i in self.weights else next(stored)
                  for i in range(self.treedef.num_leaves)]
        return jax.tree.unflatten(self.treedef, leaves)(cotangent)


def _aval(x):
    return x.shape, x.dtype
