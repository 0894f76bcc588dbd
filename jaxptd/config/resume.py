"""A resumed run's config against the one its checkpoint was written with: which keys it
may change without a warning (RESUME_FREE), the ones it changed (`changed_keys`), those it
may change only when asked (ASKED, `refused_change`), the words for a checkpoint of another
model's shape (`model_mismatch`), and the learning-rate schedule's length it keeps
(`continued`).
"""
from __future__ import annotations

import dataclasses

from jaxptd.config.schema import Config

# Keys a resumed run may change without a warning: the layout, where files go, how often
# to log, save and evaluate, how long to train, and how the same model computes (FP8
# GEMMs: the state holds no FP8 value).
RESUME_FREE = ("parallel.", "runtime.", "checkpoint.", "train.steps", "train.run_dir",
               "train.log_every", "train.eval_every", "train.eval_batches",
               "train.wandb_project", "model.kernels", "model.attention", "model.remat",
               "model.scan_layers", "model.fp8")


# Keys whose change a checkpoint survives but a run should not make by accident: the
# restore pads or cuts the padded vocabulary rows, so another model.vocab_size reads, but
# the ids then mean other tokens. `python -m jaxptd.train --allow-change KEY` allows one.
ASKED = ("model.vocab_size",)


def continued(config: Config, saved: dict) -> tuple[Config, str | None]:
    """`config` for a run that continues one written with the config `saved` (a
    to_dict()), and a note when that changed it.

    The learning-rate schedule keeps its length: with optimizer.decay_steps 0 (decay over
    train.steps) it is set to the saved run's decay length, so raising train.steps to go
    on does not stretch the cosine under the steps already trained (their logged rates
    stay the schedule's); past that length the rate stays at optimizer.min_lr. A
    decay_steps given explicitly wins, as Megatron's --lr-decay-iters does. Setting it
    explicitly also carries the length into the config.yaml and checkpoints this run
    writes, so later resumes keep it too.
    """
    old = saved.get("optimizer", {})
    length = old.get("decay_steps") or saved.get("train", {}).get("steps")
    if config.optimizer.decay_steps or not length or (
            length == config.train.steps and not old.get("decay_steps")):
        return config, None
    kept = dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, decay_steps=int(length)))
    if length == config.train.steps:
        return kept, None
    return kept, (f"train.steps={config.train.steps}: the learning-rate schedule keeps the "
                  f"length of the run this one continues (optimizer.decay_steps={length}), so"
                  f" the rate stays at optimizer.min_lr after step {length}; set "
                  "optimizer.decay_steps to decay over another length")


def changed_keys(saved: dict, config: Config) -> list[str]:
    """'key old -> new' for every setting that differs from the saved config's `saved`
    (a to_dict()), other than RESUME_FREE ones."""
    changes = []
    for section, values in config.to_dict().items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            old = saved.get(section, {}).get(key, value)
            if old != value and not dotted.startswith(RESUME_FREE):
                changes.append(f"{dotted} {old!r} -> {value!r}")
    return changes


def refused_change(saved: dict, config: Config, allowed: tuple[str, ...] = ()) -> str | None:
    """Why a run may not resume from a step written with `saved` (a to_dict()): a change of
    an ASKED key that `allowed` does not name; None when there is none."""
    asked = [c for c in changed_keys(saved, config)
             if c.split()[0] in ASKED and c.split()[0] not in allowed]
    if not asked:
        return None
    keys = " ".join(f"--allow-change {c.split()[0]}" for c in asked)
    return (f"{', '.join(asked)} against the checkpoint this run resumes: set it back, or "
            f"pass {keys} to resume with it (the token ids then mean other tokens), or use a "
            "new train.run_dir and checkpoint.dir")


def model_mismatch(saved: dict, config: Config) -> str | None:
    """The model keys (old -> new) that make a checkpoint written with `saved` another
    model's shape than `config`'s, in words; None when no model key changed."""
    changes = [c for c in changed_keys(saved, config) if c.startswith("model.")]
    if not changes:
        return None
    return (f"{', '.join(changes)} against the checkpoint this run resumes: a model's "
            "shape cannot change on resume; set them back, or use a new train.run_dir and "
            "checkpoint.dir")
