"""The checks of a job's config that need more than the config, run after `load_config`
and before any work starts: the checkpoint the job would start from (checked as the ranks
will), the KV capacity of a replica (the engines' memory model) and the RL task built as
the controller will build it. `pivotrl run`, `pivotrl submit`, the Slurm launcher and
`pivotrl config` run them; each error is a ConfigError naming the key to fix, as config's
own checks are (config is the bottom layer and imports none of these)."""
from __future__ import annotations

from pathlib import Path

from pivotrl_hpc.config import Config, ConfigError, load_config
from pivotrl_hpc.config.schema import ModelConfig


def preflight(cfg: Config) -> None:
    check_start(cfg)
    check_kv_capacity(cfg)
    check_task(cfg)


def preflight_slurm(cfg: Config) -> None:
    """`preflight` for a Slurm job: it writes into its own run folder, runs/<name>-<id>/,
    not the config's trace.path (only the trace's file name is kept), so `resume=auto` has
    nothing of the local trace.path to check there; a `resume=PATH` still is checked."""
    from dataclasses import replace

    from pivotrl_hpc.config.schema import names_a_path

    preflight(cfg if names_a_path(cfg.resume) else replace(cfg, resume=False))


def load_checked(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """`load_config` with its file checks, then `preflight`."""
    cfg = load_config(path, list(overrides))
    preflight(cfg)
    return cfg


def check_start(cfg: Config) -> None:
    """The checkpoint the job would start from, checked as the ranks will: against the
    config the paradigm implies (colocated: staleness 0), which the ranks read."""
    from pivotrl_hpc.checkpoint.folders import RunFolderError
    from pivotrl_hpc.checkpoint.layout import CheckpointError
    from pivotrl_hpc.checkpoint.state import prepare
    from pivotrl_hpc.config.paradigm import normalize

    try:
        prepare(normalize(cfg))
    except RunFolderError as e:   # the run folder itself (issue 46), before any resume
        raise ConfigError("trace.path", str(e)) from None
    except CheckpointError as e:
        raise ConfigError("resume", str(e)) from None


def check_kv_capacity(cfg: Config) -> None:
    """A sequence at its longest must fit one replica's KV cache, or the scheduler can never
    place it and the job waits forever (the paper groups at the CPU default of 16 MB did).
    The cache is derived from the device (gps/memory.py) unless roles.kv_cache_mb
    overrides it."""
    from pivotrl_hpc.gps.memory import KVBudget

    for name, role in (("policy", "rollout"), ("genrm", "reward")):
        m: ModelConfig = getattr(cfg.models, name)
        kv = KVBudget(cfg, name)
        need, have = m.max_prompt_len + m.max_response_len, kv.replica_tokens
        if need <= have:
            continue
        if kv.override:
            per_token = kv.shape.kv_bytes_per_token(kv.b)
            raise ConfigError("roles.kv_cache_mb",
                              f"{cfg.roles.kv_cache_mb} MB per {role} replica holds {have} "
                              f"tokens of {name} ({per_token} bytes a token), fewer than its "
                              f"longest sequence (max_prompt_len + max_response_len = {need}); "
                              f"raise it to at least {-(-need * per_token // 2**20)}, or set "
                              f"0 to derive it from the device's memory")
        raise ConfigError("cluster.device_memory_gib",
                          f"a {role} replica holds {have} tokens of {name}, fewer than its "
                          f"longest sequence ({need}): {kv.explain()}; give it more devices "
                          f"(models.{name}.tensor_parallel), a larger device or a higher "
                          f"roles.gpu_memory_utilization")


def check_task(cfg: Config) -> None:
    """Build the RL task as the controller will (pivotrl_hpc.task): every data row, chat
    template, compute_score (called once) and judge template, before any worker starts."""
    from pivotrl_hpc.task.errors import TaskError
    from pivotrl_hpc.task.task import build_task

    try:
        build_task(cfg)
    except TaskError as e:
        raise ConfigError(e.key, str(e)) from None
