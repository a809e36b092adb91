"""YAML + dotted overrides -> typed `Config`, rejecting unknown keys with a did-you-mean."""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.schema import Config, names_a_path

log = logging.getLogger(__name__)


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
    if get_origin(tp) is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"{value!r} is a {type(value).__name__}, expected a list")
        return [_coerce(v, get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(tp, types.UnionType):
        for arm in get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError:
                pass
        names = " or ".join(a.__name__ for a in get_args(tp))
        raise ConfigError(key, f"{value!r} is a {type(value).__name__}, expected {names}")
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
    try:
        return key.split("."), yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {raw!r} is not valid YAML ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


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


def resolve_paths(cfg: Config, base: Path, check_files: bool = True,
                  typed: frozenset[str] = frozenset()) -> Config:
    """Relative paths: a path typed on the command line (`typed`: its dotted keys) is taken
    from where the command runs (cwd); one a config file gives, from that file's folder
    (`base`), except the task's input files (data, a template file, a compute_score file),
    looked up in cwd first (an error names both folders when neither has it)."""
    def fix(key: str, p: str, root: Path | None = None) -> str:
        root = root or (Path.cwd() if key in typed else base)
        try:
            p.encode("utf-8")
            return str((root / p).resolve()) if p and not Path(p).is_absolute() else p
        except (ValueError, OSError) as e:   # a NUL byte, a lone surrogate, a loop
            raise ConfigError(key, f"{p!r} is not a usable path ({e})") from None

    def given(key: str, p: str, needed: bool = True) -> str:
        here, there = fix(key, p, Path.cwd()), fix(key, p, base)
        if Path(here).exists() or here == there:
            return here
        if key in typed:
            if check_files and needed:
                raise ConfigError(key, f"{p} is not in {Path.cwd()} (where the command runs, "
                                       f"which a path typed on the command line is taken "
                                       f"from)")
            return here
        if Path(there).exists():
            return there
        if check_files and needed:
            raise ConfigError(key, f"{p} is in neither {Path.cwd()} (where the command runs) "
                                   f"nor {base} (the config file's folder)")
        return here

    for name in ("policy", "genrm"):
        m = getattr(cfg.models, name)
        m.path = fix(f"models.{name}.path", m.path)
    files = cfg.data.format != "synthetic"
    cfg.data.train = given("data.train", cfg.data.train, files)
    cfg.data.validation = given("data.validation", cfg.data.validation, files)
    r = cfg.reward   # a template file or a compute_score file, not a family or module name
    if "/" in r.genrm_template or r.genrm_template.endswith((".txt", ".jinja")):
        r.genrm_template = given("reward.genrm_template", r.genrm_template)
    where, colon, name = r.verifiable.rpartition(":")
    if colon and where.endswith(".py"):
        r.verifiable = given("reward.verifiable", where) + ":" + name
    cfg.trace.path = fix("trace.path", cfg.trace.path)
    cfg.paradigm.throughput_profile = fix("paradigm.throughput_profile",
                                          cfg.paradigm.throughput_profile)
    if names_a_path(cfg.resume):
        cfg.resume = fix("resume", cfg.resume)
    return cfg


def _read(path: Path) -> dict:
    """One config file's mapping: YAML, or a run's resolved <name>.config.json (`pivotrl
    resume`) as JSON, since YAML 1.1 reads a float like 1e-07 as a string."""
    try:
        text = path.read_text(encoding="utf-8")
        data = (json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)) or {}
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError("<file>", f"{path} is not valid "
                          f"{'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{_first_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError("<file>", f"{path} holds a {type(data).__name__}, not a mapping")
    return data


def _merge(base: dict, over: dict) -> dict:
    """`over`'s keys replace `base`'s, section by section."""
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every non-mapping value under `data`."""
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


Sections = bool | tuple[str, ...]


def _included(data: dict, path: Path, use: Sections) -> tuple[dict, dict[str, str]]:
    """Apply the file's `include` (a path or a list, relative to it) under the file: its
    own keys win over every included file's (a later include over an earlier one), and a
    key set in both with another value is logged; the command line's overrides come last.
    A paper config includes its calibration this way (configs/calibration/,
    docs/calibration.md). An included file's top-level `record` and `implied` are its
    documentation (the fit, its residuals, the sources, its efficiencies), not loaded.
    `use`: True every section of the included files, False none (the include dropped), a
    tuple only those top-level sections (`reproduce --hardware datasheet` keeps the
    calibration's assumptions).
    Returns the mapping and where each of its values comes from (dotted key -> file)."""
    names = data.pop("include", None)
    origins = dict.fromkeys(leaves(data), str(path))
    if names is None or use is False:
        return data, origins
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError("include", f"{names!r} is not a file name or a list of them")
    base: dict = {}
    theirs_from: dict[str, str] = {}   # dotted key -> the included file that sets it
    for name in names:
        inc = (path.parent / name).resolve()
        if not inc.is_file():
            raise ConfigError("include", f"{path} includes {inc}, which does not exist "
                              f"(a paper group's calibration is written by `pivotrl "
                              f"reproduce calibrate`)")
        extra = _read(inc)
        extra.pop("record", None)
        extra.pop("implied", None)   # a calibration's efficiencies: documentation too
        if "include" in extra:
            raise ConfigError("include", f"{inc} includes further files; one level only")
        if use is not True:
            extra = {k: v for k, v in extra.items() if k in use}
        _merge(base, extra)
        theirs_from.update(dict.fromkeys(leaves(extra), str(inc)))
    theirs = leaves(base)
    for key, value in leaves(data).items():
        if key in theirs and theirs[key] != value:
            log.info("%s: %r of %s wins over %r of %s", key, value, path, theirs[key],
                     theirs_from[key])
    return _merge(base, data), {k: f"{v} (included)" for k, v in theirs_from.items()
                                if k not in origins} | origins


def layered(path: str | Path | None, overrides: list[str] = (), *,
            includes: Sections = True) -> tuple[dict, dict[str, str], Path]:
    """The merged mapping of a config file, its includes and the command line's
    overrides; where each value comes from; the folder relative paths resolve against."""
    data: dict = {}
    origins: dict[str, str] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("<file>", f"config file {path} does not exist")
        data, origins = _included(_read(path), path, includes)
        base = path.resolve().parent
    for item in overrides:
        keys, value = parse_override(item)
        prefix = ".".join(keys)
        origins = {k: v for k, v in origins.items()
                   if k != prefix and not k.startswith(prefix + ".")}
        origins.update(dict.fromkeys(leaves(value, prefix), "command line"))
    return apply_overrides(data, list(overrides)), origins, base


def load_explained(path: str | Path | None, overrides: list[str] = (), *,
                   check_files: bool = True,
                   includes: Sections = True) -> tuple[Config, dict[str, str]]:
    """`load_config`, and where each value set by a file or the command line comes from."""
    from pivotrl_hpc.config.validate import validate

    data, origins, base = layered(path, overrides, includes=includes)
    typed = frozenset(k for k, v in origins.items() if v == "command line")
    cfg = resolve_paths(build(Config, data), base, check_files, typed)
    _check_calibration(cfg)
    validate(cfg, check_files=check_files)
    return cfg, origins


def load_config(path: str | Path | None, overrides: list[str] = (), *,
                check_files: bool = True, includes: Sections = True) -> Config:
    """Load, include, override, type-check and validate; raise ConfigError naming the key."""
    return load_explained(path, overrides, check_files=check_files, includes=includes)[0]


def _check_calibration(cfg: Config) -> None:
    c = cfg.calibration
    for name in ("policy_scale", "genrm_scale", "train_scale"):
        if not getattr(c, name) > 0:
            raise ConfigError(f"calibration.{name}", f"{getattr(c, name)} must be > 0")
    for f in dataclasses.fields(c):
        if f.name.startswith("shift_") and getattr(c, f.name) < 0:
            raise ConfigError(f"calibration.{f.name}", f"{getattr(c, f.name)} must be >= 0 "
                              "(0: the datasheet's)")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
