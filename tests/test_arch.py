"""What each model family declares on its JAX-free `Family` record (read by the planner
and the config rules without the Flax model) against what its model is: a gated MLP has
a gate weight, an encoder has nothing to decode, a family that may have experts accepts
model.moe_experts."""
import jax
import pytest

from jaxptd import model as models
from jaxptd.arch import FAMILIES
from jaxptd.config import ConfigError, load_config


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_facts_are_its_models(name):
    family = FAMILIES[name]
    config = load_config(None, [f"model.arch={name}"])
    arch = models.get(config.model)
    shapes = jax.eval_shape(lambda: arch.init_params(config.model,
                                                     config.model.padded_vocab(1),
                                                     jax.random.key(0)))
    leaves = {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    assert family.gated_mlp == ("w_gate" in leaves), leaves
    assert family.encoder == (arch.decoder is None)
    try:
        load_config(None, [f"model.arch={name}", "model.moe_experts=4"])
        accepts_experts = True
    except ConfigError:
        accepts_experts = False
    assert family.experts == accepts_experts
