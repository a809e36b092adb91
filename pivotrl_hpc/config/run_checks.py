"""Checks of what a run keeps and tells (trace.loggers, trace.samples) and of a setting
copied from an emulation config onto a real job (workload.length_mode: budget)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.schema import LOGGERS, Config

log = logging.getLogger(__name__)


def trace_settings(cfg: Config) -> None:
    t = cfg.trace
    for i, name in enumerate(t.loggers):
        if name not in LOGGERS:
            raise ConfigError(f"trace.loggers[{i}]", f"{name!r} is not one of "
                                                     f"{', '.join(LOGGERS)}")
    if "wandb" in t.loggers:
        import importlib.util
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("trace.loggers", "wandb is not installed: pip install "
                              "'pivotrl-hpc[wandb]' (WANDB_MODE=offline runs without a "
                              "network), or leave wandb out")
    if isinstance(t.samples, str) and t.samples not in ("all", "none"):
        raise ConfigError("trace.samples", f"{t.samples!r}: all, none, or samples per step")
    if isinstance(t.samples, int) and t.samples < 0:
        raise ConfigError("trace.samples", f"{t.samples} must be >= 0 (none: 0)")


def check_wandb_key(cfg: Config) -> None:
    """wandb online needs a key (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry for its
    server); without one, wandb.init fails in rank 0 once the job has started."""
    import netrc
    from urllib.parse import urlparse

    from pivotrl_hpc import envs

    if "wandb" not in cfg.trace.loggers or \
            envs.WANDB_MODE.get().lower() in ("offline", "disabled", "dryrun"):
        return
    if envs.WANDB_API_KEY.get():
        return
    host = urlparse(envs.WANDB_BASE_URL.get()).hostname or "api.wandb.ai"
    try:
        if netrc.netrc().authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError("trace.loggers", f"wandb runs online and has no key (no WANDB_API_KEY, "
                                       f"no ~/.netrc entry for {host}): `wandb login`, or "
                                       f"WANDB_MODE=offline to log without a network, or "
                                       f"leave wandb out")


REAL_VOCAB = 32000   # a folder's vocab_size from here up: a real model, not a tiny stand-in
_warned: set[str] = set()


def check_length_mode(cfg: Config) -> str | None:
    """`workload.length_mode: budget` ignores EOS (emulation); on GPUs or real model folders
    it is almost surely a copied setting: warn once per process, naming `eos`. Returns the
    warning (None: nothing to say)."""
    if cfg.workload.length_mode != "budget":
        return None
    why = "cluster.device_kind is gpu" if cfg.cluster.device_kind == "gpu" else None
    for name in ("policy", "genrm"):
        path = getattr(cfg.models, name).path
        try:
            vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if why is None and path and vocab >= REAL_VOCAB:
            why = f"models.{name}.path holds a real model (vocab_size {vocab})"
    if why is None:
        return None
    msg = (f"workload.length_mode is budget, but {why}: every response and judgement runs to "
           "a drawn length with EOS ignored (an emulation of the paper's length tail); a "
           "real job wants workload.length_mode: eos")
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)
    return msg
