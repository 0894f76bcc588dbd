"""Configuration: frozen dataclasses read from YAML with dotted ``key=value`` overrides.

The package's public API, imported as ``from jaxptd.config import ...``; its modules each
own one part:

- `schema.py`: the dataclasses (one per YAML section), their defaults and derived values,
  and ``ConfigError``;
- `load.py`: YAML + ``section.key=value`` overrides -> a validated ``Config``
  (`load_config`, `from_dict`);
- `rules.py`: every validation rule but a model family's own (`validate`), and the
  device-count rule (`check_device_count`);
- `resume.py`: a resumed run's config against its checkpoint's (`continued`,
  `changed_keys`).

All validation happens before any device work and without JAX (the planner and the CLIs'
--help rely on it), and every failure is a ``ConfigError`` whose message is one line
naming the key, the value and the rule; the entry points print it as ``error: ...`` and
exit 2.
"""
from jaxptd.config.load import from_dict, load_config
from jaxptd.config.resume import changed_keys, continued
from jaxptd.config.rules import CHOICES, check_device_count, validate
from jaxptd.config.schema import Config, ConfigError, ModelConfig, ParallelConfig

__all__ = [
    "CHOICES", "Config", "ConfigError", "ModelConfig", "ParallelConfig", "changed_keys",
    "check_device_count", "continued", "from_dict", "load_config",
    "validate",
]
