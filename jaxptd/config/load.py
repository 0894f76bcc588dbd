"""Reading a config: a YAML file of sections, dotted ``section.key=value`` overrides on
top, each leaf coerced to its dataclass field's type, then validated (`load_config`); the
same from a {section: {key: value}} tree (`from_dict`: a checkpoint's or config.json's
record).

A YAML file holds only what differs from the defaults in `schema.py`, as sections
(``model:``, ``parallel:``, ...). Overrides use the same names: ``parallel.tensor=4``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from jaxptd.config.rules import validate
from jaxptd.config.schema import Config, ConfigError


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Checks one leaf against its dataclass annotation ('int', 'float', 'str', 'bool')."""
    if annotation == "bool":
        if isinstance(value, bool):
            return value
    elif annotation == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation == "str":
        if isinstance(value, bool):  # YAML reads true/false as booleans
            return "true" if value else "false"
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}={value!r}: expected {annotation}, got {type(value).__name__}")


def _section_types(section_cls) -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(section_cls)}


def _build(tree: dict[str, Any]) -> Config:
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    built = {}
    for name, values in tree.items():
        if name not in sections:
            raise ConfigError(f"{name}: unknown section (known: {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{name}={values!r}: a section must be a mapping of keys")
        section_cls = sections[name]
        types = _section_types(section_cls)
        if name == "runtime" and "platform" in values and "target" not in values:
            # runtime.platform (auto | cpu | gpu) was renamed runtime.target: configs and
            # checkpoints written before still load
            values = {("target" if k == "platform" else k): v for k, v in values.items()}
        kwargs = {}
        for key, value in values.items():
            dotted = f"{name}.{key}"
            if key not in types:
                raise ConfigError(f"{dotted}: unknown key (known: {', '.join(types)})")
            kwargs[key] = _coerce(dotted, value, types[key])
        built[name] = section_cls(**kwargs)
    return Config(**built)


def _set_dotted(tree: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"{override!r}: an override must look like section.key=value")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{dotted!r}: an override key must be section.key, e.g. parallel.tensor")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    section = tree.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"{parts[0]}: a section must be a mapping of keys")
    section[parts[1]] = value


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Reads YAML `path` (None: defaults only), applies overrides, validates.

    Raises ConfigError (one line) for a missing or malformed file, unknown keys, wrong
    types and impossible combinations.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: file not found") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"--config {path}: not a readable file ({e.strerror})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "invalid YAML"
            raise ConfigError(f"--config {path}: malformed YAML{where}: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
        tree = loaded or {}
    for override in overrides:
        _set_dotted(tree, override)
    config = _build(tree)
    validate(config)
    return config


def from_dict(tree: dict[str, Any]) -> Config:
    """A validated Config from {section: {key: value}} (e.g. a checkpoint's record of its
    config); raises ConfigError like load_config."""
    config = _build(tree)
    validate(config)
    return config
