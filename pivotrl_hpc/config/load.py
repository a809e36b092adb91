"""YAML + dotted overrides -> typed `Config`, rejecting unknown keys with a did-you-mean."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.schema import Config


def _did_you_mean(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown key{hint} (allowed: {', '.join(sorted(choices))})"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; int -> float is the one coercion."""
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if get_origin(tp) is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(key, f"{value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(key, f"{value!r} is a {type(value).__name__}, expected {tp.__name__}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """Construct dataclass `cls` from a nested dict, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix or "<root>", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(full, _did_you_mean(str(key), names))
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`rl.steps=3` -> (['rl', 'steps'], 3); the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(item, "an override must look like section.key=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key, "an override key must be dotted names, e.g. rl.steps")
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(path), f"'{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def resolve_paths(cfg: Config, base: Path) -> Config:
    """Relative paths (models, data, trace, throughput profile) are relative to the config
    file's folder, overrides included: pass absolute paths to put a run elsewhere."""
    def fix(p: str) -> str:
        return str((base / p).resolve()) if p and not Path(p).is_absolute() else p

    for m in (cfg.models.policy, cfg.models.genrm):
        m.path = fix(m.path)
    cfg.data.train, cfg.data.validation = fix(cfg.data.train), fix(cfg.data.validation)
    cfg.trace.path = fix(cfg.trace.path)
    cfg.paradigm.throughput_profile = fix(cfg.paradigm.throughput_profile)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = (), *,
                check_files: bool = True) -> Config:
    """Load, override, type-check and validate; raise ConfigError naming the key."""
    from pivotrl_hpc.config.validate import validate

    data: dict = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("<file>", f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        base = path.resolve().parent
    cfg = resolve_paths(build(Config, apply_overrides(data, list(overrides))), base)
    validate(cfg, check_files=check_files)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
