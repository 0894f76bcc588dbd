"""Config: every shipped YAML parses, overrides apply, and each rule refuses bad input."""
import glob
import os

import pytest
import yaml

from jaxptd.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"),
                                                  recursive=True)))
def test_every_shipped_config_parses(path):
    """Each shipped YAML loads, and every key it sets holds its value in the config:
    nothing dropped, renamed or coerced to another value (an int key stays an int; a
    number key may widen an int to a float)."""
    with open(path) as f:
        tree = yaml.safe_load(f)
    config = load_config(path)
    for section, values in tree.items():
        for key, value in values.items():
            loaded = getattr(getattr(config, section), key)
            if isinstance(loaded, float) and isinstance(value, str):  # YAML reads 1e-4 as a string
                value = float(value)
            assert loaded == value and (type(loaded) is type(value) or (
                type(loaded), type(value)) == (float, int)), (f"{section}.{key}", loaded, value)


def test_overrides_apply_with_types():
    config = load_config(None, ["parallel.tensor=2", "model.dtype=bfloat16",
                                "optimizer.lr=3e-4", "optimizer.zero1=true"])
    assert config.parallel.tensor == 2
    assert config.model.dtype == "bfloat16"
    assert config.optimizer.lr == pytest.approx(3e-4)
    assert config.optimizer.zero1 is True


def test_vocab_padded_to_multiple_of_128_times_tensor():
    config = load_config(None, ["model.vocab_size=50257"])
    assert config.model.padded_vocab(1) == 50304  # Megatron's GPT-2 padding at t = 1
    assert config.model.padded_vocab(8) == 51200
    assert config.model.padded_vocab(2) % 256 == 0


@pytest.mark.parametrize("overrides, fragment", [
    (["model.num_heads=6", "model.hidden_size=128"], "model.hidden_size=128: must be divisible"),
    (["model.num_heads=4", "parallel.tensor=8"], "model.num_heads=4: must be divisible by parallel.tensor=8"),
    (["model.num_layers=6", "parallel.pipe=4"], "model.num_layers=6: must be divisible by parallel.pipe x parallel.chunks"),
    (["train.global_batch=10", "parallel.data=4"], "train.global_batch=10: must be divisible"),
    (["parallel.data=3", "train.global_batch=24", "runtime.cpu_devices=8"], "must equal the device count 8"),
    (["parallel.chunks=2"], "parallel.chunks=2: more than one chunk per rank needs"),
    (["parallel.pipe=2", "parallel.schedule=zb-v"],
     "parallel.chunks=1: parallel.schedule=zb-v needs parallel.chunks=2"),
    (["model.dtype=float64"], "model.dtype='float64': must be one of"),
    (["model.dtype=float16"], "needs optimizer.loss_scale=dynamic"),
    (["model.nonsense=1"], "model.nonsense: unknown key"),
    (["nonsense.key=1"], "nonsense: unknown section"),
    (["train.steps=ten"], "train.steps='ten': expected int"),
    (["train.steps=-1"], "train.steps=-1: must be positive"),
    (["parallel.tensor"], "an override must look like section.key=value"),
    (["model.norm_position=post"], "only model.arch=bert has post-LayerNorm"),
    (["model.arch=llama", "model.gelu=erf"], "model.gelu=erf: llama has no GeLU"),
    (["model.rope_scaling=llama3"], "model.rope_scaling=llama3: only model.arch=llama has rotary"),
    (["model.arch=llama", "model.rope_scaling=yarn"], "model.rope_scaling='yarn': must be one of none, llama3"),
    (["model.arch=llama", "model.rope_factor=0"], "model.rope_factor=0.0: must be positive"),
    (["model.arch=llama", "model.rope_scaling=llama3", "model.rope_high_freq_factor=1"],
     "model.rope_high_freq_factor=1.0: must exceed model.rope_low_freq_factor=1.0"),
    (["model.arch=llama", "model.rope_factor=4"], "model.rope_factor=4.0: only model.rope_scaling=llama3 reads it"),
    (["model.special_ids=0,1,2,3"], "only model.arch=bert has special tokens"),
    (["model.arch=bert", "model.special_ids=1,2,3"], "must be four different ids"),
    (["model.arch=bert", "model.special_ids=0,1,1,2"], "must be four different ids"),
    (["model.arch=bert", "model.special_ids=0,1,2,257"], "in [0, model.vocab_size=257)"),
    (["model.arch=bert", "model.special_ids=a,b,c,d"], "must be four different ids"),
    (["optimizer.name=lamb"], "optimizer.name='lamb': must be one of adamw, sgd"),
    (["optimizer.name=sgd", "optimizer.momentum=1"], "optimizer.momentum=1.0: must be in [0, 1)"),
    (["model.arch=bert", "data.pack=true"], "data.pack=true: model.arch=bert has no packed rows"),
    (["data.eod_id=257"], "data.eod_id=257: must be a token id below model.vocab_size=257"),
    (["data.eod_id=-2"], "data.eod_id=-2: must be a token id below"),
    (["parallel.context=2", "parallel.data=2", "parallel.tensor=2", "model.kernels=pallas",
      "model.seq_len=384"], "model.seq_len=384: the ring's Pallas flash blocks"),
])
def test_rules_refuse_with_one_line_naming_key_value_rule(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_malformed_and_missing_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML at line"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(listy))


def test_a_continued_run_keeps_its_learning_rate_schedule():
    """Raising train.steps (decay_steps 0) keeps the decay length the steps were trained
    with; an explicit decay_steps wins; an unchanged run is left alone. The schedule
    itself is optax's, checked against the formula: min_lr past the kept length."""
    from jaxptd.config import continued
    from jaxptd.train.optim import lr_schedule
    saved = load_config(None, ["train.steps=300", "optimizer.warmup_steps=10"]).to_dict()
    longer = load_config(None, ["train.steps=500", "optimizer.warmup_steps=10"])
    kept, note = continued(longer, saved)
    assert kept.optimizer.decay_steps == 300 and kept.decay_length == 300
    assert "optimizer.decay_steps=300" in note and "train.steps=500" in note
    schedule, original = lr_schedule(kept), lr_schedule(load_config(None, [
        "train.steps=300", "optimizer.warmup_steps=10"]))
    assert all(float(schedule(s)) == float(original(s)) for s in (0, 10, 150, 299))
    assert float(schedule(400)) == pytest.approx(kept.optimizer.min_lr)
    again, note = continued(load_config(None, ["train.steps=500"]), kept.to_dict())
    assert again.optimizer.decay_steps == 300 and note  # later resumes keep it
    same, note = continued(load_config(None, ["train.steps=300"]), saved)
    assert same.optimizer.decay_steps == 0 and note is None
    explicit = load_config(None, ["train.steps=500", "optimizer.decay_steps=500"])
    assert continued(explicit, saved) == (explicit, None)


def test_registry_finds_every_family_module(tmp_path):
    """jaxptd/arch/__init__.py lists no family: a module of the package defining FAMILY is
    one (here a copy of the package with a toy family beside gpt), in module-name order,
    a model.arch choice at once; the registry stays JAX-free."""
    import shutil
    import subprocess
    import sys
    shutil.copytree(os.path.join(ROOT, "jaxptd"), tmp_path / "jaxptd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "jaxptd" / "arch" / "toy.py").write_text(
        "import dataclasses\nfrom jaxptd.arch import gpt\n"
        "FAMILY = dataclasses.replace(gpt.FAMILY, name='toy')\n")
    code = ("import sys; from jaxptd.arch import FAMILIES; "
            "from jaxptd.config import load_config; "
            "assert load_config(None, ['model.arch=toy']).model.arch == 'toy'; "
            "assert 'jax' not in sys.modules, 'jax imported'; print(*FAMILIES)")
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}
                           ).stdout.split()
    assert found == ["bert", "gpt", "llama", "toy"]


def test_validation_never_starts_jax():
    """Config validation asks the architecture registry (jaxptd/arch) for each family's
    rules without importing a model, and the planner's modules import none at their top:
    `plan --verify` starts JAX itself, after load_config, with the XLA_FLAGS that dump the
    step (started before, the dump and the device peak it gives are lost)."""
    import subprocess
    import sys
    code = ("import sys; from jaxptd.config import load_config; "
            "[load_config(None, [f'model.arch={a}']) for a in ('gpt', 'llama', 'bert')]; "
            "import jaxptd.plan.planner, jaxptd.plan.program, jaxptd.plan.verify; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
