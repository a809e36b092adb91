"""Where a run's metrics go besides its trace (`trace.loggers`, veRL's `trainer.logger`):
`console` (the log lines), `tensorboard` (event files beside the trace) and `wandb`
(Weights & Biases, an optional extra: `pip install 'pivotrl-hpc[wandb]'`; WANDB_MODE=offline
writes the run under the trace's folder without any network).

wandb gets each `steps` row under veRL's metric names where veRL has one (`VERL_NAMES`;
docs/trace.md lists them), the others as `pivotrl/<column>`, each evaluation as
`val-core/<data_source>/acc/mean@<rl.eval_samples>` (veRL's validation metric), and the
`samples` rows as one table at the end of the run. Every metric is plotted against
`training/global_step` (veRL's step: the steps trained), since an evaluation finishes after
later steps have been logged.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from .tensorboard import tensorboard_dir

from pivotrl_hpc.checkpoint.layout import base_trace

from pivotrl_hpc import envs

log = logging.getLogger(__name__)


# steps column -> veRL's name for the same number (verl/trainer/ppo/metric_utils.py)
VERL_NAMES = {
    "version": "training/global_step",   # = step + 1: the steps trained
    "reward_mean": "critic/score/mean",   # the sequence reward, no KL penalty here
    "loss": "actor/pg_loss",
    "seconds": "timing_s/step",
}
SAMPLE_COLUMNS = ("step", "kind", "data_source", "prompt", "response", "judgement", "parse",
                  "verifiable", "genrm", "reward", "correct")


def step_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A `steps` row's numbers under veRL's names (pivotrl/<column> where veRL has none)."""
    out = {}
    for column, value in row.items():
        if column in ("t", "step", "prompts") or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        out[VERL_NAMES.get(column, f"pivotrl/{column}")] = value
    return out


def validation_metrics(row: dict[str, Any], samples_each: int) -> dict[str, float]:
    source = row.get("data_source") or "all"
    return {"training/global_step": row["step"],
            f"val-core/{source}/acc/mean@{samples_each}": row["accuracy"]}


class WandbLogger:
    """One wandb run per trace, in the trace's folder (wandb/ there)."""

    def __init__(self, trace_path: str | os.PathLike, meta: dict) -> None:
        import wandb

        self.wandb = wandb
        config = meta.get("config") or {}
        self.samples_each = int(config.get("rl", {}).get("eval_samples", 1))
        folder = Path(trace_path).parent
        # every segment of a run logs to one wandb run: the run's id (controller.live.run_id)
        run_id = meta.get("run_id") or None
        self.run = wandb.init(project=envs.WANDB_PROJECT.get(), id=run_id,
                              resume="allow" if run_id else None,
                              name=base_trace(Path(trace_path)).stem, dir=str(folder),
                              config=config)
        self.run.define_metric("training/global_step")
        self.run.define_metric("*", step_metric="training/global_step")
        self.rows: list[list[Any]] = []

    def row(self, table: str, row: dict[str, Any]) -> None:
        if table == "steps":
            self.run.log(step_metrics(row))
        elif table == "validation":
            self.run.log(validation_metrics(row, self.samples_each))
        elif table == "samples":
            self.rows.append([row.get(c) for c in SAMPLE_COLUMNS])

    def close(self) -> None:
        if self.rows:
            self.run.log({"samples": self.wandb.Table(columns=list(SAMPLE_COLUMNS),
                                                      data=self.rows)})
        self.run.finish()


def sinks(trace_path: str | os.PathLike, trace_cfg, meta: dict) -> dict[str, Any]:
    """TraceWriter's `tensorboard`, `loggers` and `group_shared` arguments for `trace`."""
    names = trace_cfg.loggers
    tb = tensorboard_dir(trace_path, trace_cfg.tensorboard or "tensorboard" in names)
    loggers = (WandbLogger(trace_path, meta),) if "wandb" in names else ()
    return {"tensorboard": tb, "loggers": loggers,
            "group_shared": bool(getattr(trace_cfg, "group_shared", False))}
