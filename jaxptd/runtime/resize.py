"""A run that resumes, maybe on another number of data-parallel ranks: what it keeps.

Owns the config a resumed run trains with (`resumed`): the learning-rate schedule's length
(config.continued) and the microbatch size, the rule of a restart on fewer (or more) hosts,
such as a requeued SLURM job given half its nodes. The checkpoint restores into any layout
(jaxptd/checkpoint/), and the global batch is a key of its own (train.global_batch), so one
override, parallel.data, moves a run. What would change with it is the microbatch size,
global_batch / (data x microbatches): half the ranks would each take microbatches twice the
size, and their activations twice the memory. So, as Megatron's --micro-batch-size does, the
microbatch size is kept and the microbatch count scaled: data 4 -> 2 turns
parallel.microbatches 2 into 4, the same global batch in the same sequences, the same loss
to rounding.

The rule applies only when the run leaves parallel.microbatches as the checkpoint had it
(a count set anew is the user's), the kept size divides the new share of the batch and the
new count passes the config's rules (a pipeline's schedule may need a multiple of pipe).
"""
from __future__ import annotations

import dataclasses

from jaxptd.config import Config, ConfigError, continued, validate


def resumed(config: Config, saved: dict) -> tuple[Config, tuple[str, ...]]:
    """(config, notes): `config` for a run that resumes a checkpoint written with the
    config `saved` (a to_dict()), with a note for each change made to it."""
    config, schedule = continued(config, saved)
    config, batch = same_microbatch_size(config, saved)
    return config, tuple(note for note in (schedule, batch) if note)


def same_microbatch_size(config: Config, saved: dict) -> tuple[Config, str | None]:
    """(config, note): `config` with parallel.microbatches scaled so that the microbatch
    size of the run written with `saved` (a to_dict()) stays; the config itself and None
    when nothing changes or the rule does not apply."""
    par, old = config.parallel, saved.get("parallel", {})
    old_data, old_count = old.get("data", par.data), old.get("microbatches")
    old_batch = saved.get("train", {}).get("global_batch")
    if old_data == par.data or old_count != par.microbatches or not old_batch \
            or old_batch % (old_data * old_count):
        return config, None
    size = old_batch // (old_data * old_count)  # sequences a microbatch, as saved
    share = config.train.global_batch // par.data  # sequences a data rank takes now
    if config.train.global_batch % par.data or share % size:
        return config, None
    count = share // size
    kept = dataclasses.replace(config, parallel=dataclasses.replace(par, microbatches=count))
    try:
        validate(kept)
    except ConfigError:
        return config, None
    return kept, (f"parallel.data {old_data} -> {par.data}: parallel.microbatches "
                  f"{old_count} -> {count} keeps the checkpoint's microbatch size ({size} "
                  f"sequences) and train.global_batch={config.train.global_batch}; set "
                  "parallel.microbatches to choose another count")
