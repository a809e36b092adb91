"""What a paradigm implies for the rest of the config, applied once before anything starts.

- colocated (veRL): every device serves one stage at a time, so training spans every device,
  and the loop is synchronous (staleness 0).
Everything else is taken as written. The launcher applies this before it starts a process,
so the workers' training world and the controller agree.
"""
from __future__ import annotations

import copy
import logging

from pivotrl_hpc.config.schema import Config

log = logging.getLogger(__name__)


def normalize(cfg: Config) -> Config:
    out = copy.deepcopy(cfg)
    if out.paradigm.name == "colocated":
        total = out.total_devices
        if out.roles.train_devices != total or out.rl.staleness != 0:
            log.info("colocated: training spans all %d devices, staleness 0 (were %d, %d)",
                     total, out.roles.train_devices, out.rl.staleness)
        out.roles.train_devices, out.rl.staleness = total, 0
    return out
