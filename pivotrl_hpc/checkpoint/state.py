"""The controller's part of a checkpoint: plain JSON, no torch.

Captured right after step `step - 1`'s policy (version `version`) is replicated:
- the data cursor (prompts admitted, next sample id) and the book's RNG, so the prompts of
  every later step, their sampling seeds and length budgets are those of an uninterrupted run;
- every sample of a step not trained yet. One that finished rollout (or reward) is kept with
  its tokens, behaviour logprobs and policy version: its lag stays within the staleness bound,
  since the resumed policy is the one the checkpoint holds. One still generating restarts on
  resume with its own prompt, budget and seed (its tokens so far were on a device that is gone);
- the fitted throughput constants and tau_shift, so the planner resumes with what it learnt.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

from pivotrl_hpc.checkpoint.layout import CheckpointError
from pivotrl_hpc.protocol.engine import Sampling

log = logging.getLogger(__name__)

# What must not change between a checkpoint and the job resuming it: the batches would mean
# something else. (rl.steps may grow: a run can be extended.)
FIXED_KEYS = ("rl.batch_size", "rl.group_size", "rl.seed", "rl.staleness", "data.train",
              "models.policy.path")


# a kept sample's state -> the role it goes back to (a rewarded one waits for its step)
AGAIN = {"admitted": "rollout", "rolled": "reward"}


def capture(ctl, fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The state of `ctl` (controller.loop.Controller) between two steps."""
    book = ctl.book
    version, trained = ctl.published, ctl.step
    pending = [s for s in book.samples.values() if s.batch >= trained and s.state != "trained"]
    return {
        "step": trained, "version": version, "fixed": dict(fixed),
        "book": {"next_prompt": book.next_prompt, "next_sid": book.next_sid,
                 "rng": _rng_to_json(book.rng.getstate()), "held_s": book.held_s,
                 "unparsed": book.unparsed},
        "samples": [_sample_to_json(s) for s in sorted(pending, key=lambda s: s.sid)],
        "throughput": {role: m.model.to_dict() for role, m in ctl.models.items()},
        "tau": dict(ctl.tau.tau), "tau_counts": dict(ctl.tau.counts),
    }


def check_fixed(state: Mapping[str, Any], fixed: Mapping[str, Any], where: str) -> None:
    for key, value in state.get("fixed", {}).items():
        if key in fixed and key != "rl.steps" and fixed[key] != value:
            raise CheckpointError(f"{where} was made with {key}={value!r}, the config says "
                                  f"{fixed[key]!r}; resume=false starts afresh")
    if state["step"] > fixed.get("rl.steps", state["step"]):
        raise CheckpointError(f"{where} holds {state['step']} trained steps, more than "
                              f"rl.steps={fixed['rl.steps']}")


def restore(ctl, state: Mapping[str, Any]) -> list:
    """Put `state` into a fresh controller; returns the samples to (re)start, rollout first:
    (sample, "rollout") restarts generation, (sample, "reward") only the judgement."""
    from pivotrl_hpc.sched.model import ThroughputModel

    book, b = ctl.book, state["book"]
    book.next_prompt, book.next_sid = int(b["next_prompt"]), int(b["next_sid"])
    book.rng.setstate(_rng_from_json(b["rng"]))
    book.held_s, book.unparsed = float(b["held_s"]), int(b["unparsed"])
    by_pid = {p.pid: p for p in book.prompts}
    again = []
    for data in state["samples"]:
        s = _sample_from_json(data, by_pid)
        book.samples[s.sid] = s
        if s.state in AGAIN:
            again.append((s, AGAIN[s.state]))
    for role, consts in state["throughput"].items():
        if role in ctl.models and not ctl.models[role].fixed:
            ctl.models[role].model = ThroughputModel.from_dict(consts)
            ctl.flows[role].sched.model = ctl.models[role].model
    ctl.tau.tau.update({k: float(v) for k, v in state["tau"].items()})
    ctl.tau.counts.update({k: int(v) for k, v in state["tau_counts"].items()})
    ctl.step = int(state["step"])
    ctl.executor.published = int(state["version"])
    return again


def _sample_to_json(s) -> dict[str, Any]:
    out = {k: getattr(s, k) for k in ("sid", "batch", "budget", "judge_budget", "response",
                                      "logprobs", "version", "judge_prompt", "judgement",
                                      "state")}
    out["pid"] = s.prompt.pid
    out["sampling"] = dataclasses.asdict(s.sampling)
    out["score"] = None if s.score is None else dataclasses.asdict(s.score)
    return out


def _sample_from_json(d: Mapping[str, Any], prompts: Mapping[int, Any]):
    from pivotrl_hpc.controller.rl import Sample, Score

    if d["pid"] not in prompts:
        raise CheckpointError(f"sample {d['sid']} is of prompt {d['pid']}, which the dataset "
                              "no longer has")
    sampling = d["sampling"]
    sampling = Sampling(**{**sampling, "stop_token_ids": tuple(sampling["stop_token_ids"])})
    return Sample(int(d["sid"]), prompts[d["pid"]], int(d["batch"]), int(d["budget"]),
                  sampling, int(d["judge_budget"]), list(d["response"]), list(d["logprobs"]),
                  d["version"], list(d["judge_prompt"]), list(d["judgement"]),
                  None if d["score"] is None else Score(**d["score"]), d["state"])


def _rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


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

    # nothing is read from (or removed in) a run folder another account could write into
    check_run(cfg.trace.path, getattr(cfg.trace, "group_shared", False))
    for tmp in clean_partial(root_for(cfg.trace.path)):
        log.warning("removed %s, a checkpoint an earlier start left half written", tmp)
    path = resolve(cfg.resume, cfg.trace.path)
    if path is None:
        return None
    state = read_state(path)
    check_fixed(state, fixed_values(cfg), str(path))
    return {"path": str(path), "step": int(state["step"]), "version": int(state["version"])}
