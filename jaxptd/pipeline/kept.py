"""A backward kept from one pipeline slot for a later one, as arrays (the executor's
parallel.stash=activations)."""
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp


class Kept:
    """A `jax.vjp` backward kept from one slot for a later one, as arrays.

    `jax.make_jaxpr` traces the backward (a function of its cotangent) into a jaxpr and the
    values it closes over: every value it reads, boolean and integer ones (attention and
    dropout masks) included. (`jax.closure_convert` would not do: it bakes the values it
    deems non-differentiable, those masks, into the converted function as the first
    trace's.) Closed-over values the later slot has anyway (`given`: the chunk's weights,
    passed in again) are not stored, nor are the program's constants (not traced), taken
    from the probe. The probe (the first trace) fixes the jaxpr and the order; every later
    trace must close over values of the same shapes in it. Public APIs only:
    `jax.make_jaxpr` and `jax.extend.core`.
    """

    def __init__(self, vjp_fn, cotangent, given):
        closed, outputs = jax.make_jaxpr(vjp_fn, return_shape=True)(cotangent)
        self.jaxpr, self.outputs = closed.jaxpr, jax.tree.structure(outputs)
        self.sources = self._sources(closed.consts, given)
        self.constants = {i: c for i, (c, s) in enumerate(zip(closed.consts, self.sources))
                          if s == "constant"}
        self.templates = [jnp.zeros_like(c) for c, s in zip(closed.consts, self.sources)
                          if s is None]

    @staticmethod
    def _sources(consts, given):
        """Per closed-over value: its index in `given`, "constant" (not traced) or None
        (stored)."""
        def source(c):
            if not isinstance(c, jax.core.Tracer):
                return "constant"
            return next((i for i, g in enumerate(given) if c is g), None)
        return tuple(source(c) for c in consts)

    def keep(self, vjp_fn, cotangent, given) -> list:
        """The closed-over values to store (in buffer order)."""
        consts = jax.make_jaxpr(vjp_fn)(cotangent).consts
        sources = self._sources(consts, given)
        kept = [c for c, s in zip(consts, sources) if s is None]
        assert sources == self.sources and [(x.shape, x.dtype) for x in kept] == [
            (t.shape, t.dtype) for t in self.templates], \
            "the backward closes over different values than the probe's"
        return kept

    def run(self, cotangent, stored, given):
        """The backward from stored values and the given ones."""
        stored = iter(stored)
        consts = [self.constants[i] if s == "constant" else next(stored) if s is None
                  else given[s] for i, s in enumerate(self.sources)]
        backward = jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(self.jaxpr, consts))
        return jax.tree.unflatten(self.outputs, backward(*jax.tree.leaves(cotangent)))
