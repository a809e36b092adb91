"""The controller's part of a checkpoint: plain JSON, no torch.

Captured right after step `step - 1`'s policy (version `version`) is replicated:
- the data cursor (prompts admitted, next sample id) and the book's RNG, so the prompts of
  every later step, their sampling seeds and length budgets are those of an uninterrupted run;
- every sample of a step not trained yet. One that finished rollout (or reward) is kept with
  its tokens, behaviour logprobs and policy version: its lag stays within the staleness bound,
  since the resumed policy is the one the checkpoint holds. One still generating restarts on
  resume with its own prompt, budget and seed (its tokens so far were on a device that is gone);
- the fitted throughput constants and tau_shift, so the planner resumes with what it learnt.
The controller captures and restores that part (controller/run_state.py); this module checks
a checkpoint against the config before any rank works.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from pivotrl_hpc.checkpoint.layout import CheckpointError

log = logging.getLogger(__name__)

# What must not change between a checkpoint and the job resuming it: the batches would mean
# something else. (rl.steps may grow: a run can be extended.)
# partial rollout too: its pending samples carry deadlines, not the paper's batches
FIXED_KEYS = ("rl.batch_size", "rl.group_size", "rl.seed", "rl.staleness", "data.train",
              "models.policy.path", "paradigm.partial_rollout")


def check_fixed(state: Mapping[str, Any], fixed: Mapping[str, Any], where: str) -> None:
    for key, value in state.get("fixed", {}).items():
        if key in fixed and key != "rl.steps" and fixed[key] != value:
            raise CheckpointError(f"{where} was made with {key}={value!r}, the config says "
                                  f"{fixed[key]!r}; resume=fresh_aside moves that run aside and "
                                  "starts afresh")
    if state["step"] > fixed.get("rl.steps", state["step"]):
        raise CheckpointError(f"{where} holds {state['step']} trained steps, more than "
                              f"rl.steps={fixed['rl.steps']}")


def fixed_values(cfg) -> dict[str, Any]:
    """The config's values of FIXED_KEYS (and rl.steps, which may only grow)."""
    out = {}
    for key in (*FIXED_KEYS, "rl.steps"):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out[key] = node
    return out


def prepare(cfg) -> dict[str, Any] | None:
    """Where the job starts, checked before any rank does work: None (afresh) or the
    checkpoint's folder, step and policy version. Raises CheckpointError (RunFolderError for
    a run folder another account could write into: issue 46). The partial
    checkpoints an earlier start of the run left (killed while writing one) go first."""
    from pivotrl_hpc.checkpoint.folders import check_run
    from pivotrl_hpc.checkpoint.layout import clean_partial, read_state, resolve, root_for
    from pivotrl_hpc.checkpoint.manifest import verify

    # nothing is read from (or removed in) a run folder another account could write into
    check_run(cfg.trace.path, getattr(cfg.trace, "group_shared", False))
    for tmp in clean_partial(root_for(cfg.trace.path)):
        log.warning("removed %s, a checkpoint an earlier start left half written", tmp)
    path = resolve(cfg.resume, cfg.trace.path)
    if path is None:
        return None
    verify(path)   # before any rank loads a byte of it (checkpoint.manifest)
    state = read_state(path)
    check_fixed(state, fixed_values(cfg), str(path))
    return {"path": str(path), "step": int(state["step"]), "version": int(state["version"])}
