"""The controller's part of a checkpoint, as plain JSON (no torch): captured from a
controller between two steps and put back into a fresh one (checkpoint/state.py says what it
holds and checks a checkpoint before any rank works)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pivotrl_hpc.checkpoint.layout import CheckpointError
from pivotrl_hpc.controller.rl import Sample, Score
from pivotrl_hpc.protocol.engine import Sampling
from pivotrl_hpc.sched.model import ThroughputModel

# a kept sample's state -> the role it goes back to (a rewarded one waits for its step)
AGAIN = {"admitted": "rollout", "rolled": "reward"}


def capture(ctl, fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The state of `ctl` (controller.loop.Controller) between two steps."""
    book = ctl.book
    version, trained = ctl.published, ctl.step
    pending = [s for s in book.samples.values() if s.batch >= trained and s.state != "trained"]
    return {
        "step": trained, "version": version, "fixed": dict(fixed),
        "run": getattr(ctl, "run_id", ""),   # the run's id, the same in every segment
        "book": {"next_prompt": book.next_prompt, "next_sid": book.next_sid,
                 "rng": _rng_to_json(book.rng.getstate()), "held_s": book.held_s,
                 "unparsed": book.unparsed},
        "samples": [_sample_to_json(s) for s in sorted(pending, key=lambda s: s.sid)],
        "throughput": {role: m.model.to_dict() for role, m in ctl.models.items()},
        "tau": dict(ctl.tau.tau), "tau_counts": dict(ctl.tau.counts),
    }


def restore(ctl, state: Mapping[str, Any]) -> list:
    """Put `state` into a fresh controller; returns the samples to (re)start, rollout first:
    (sample, "rollout") restarts generation, (sample, "reward") only the judgement."""
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
                                      "state", "group")}
    out["pid"] = s.prompt.pid
    out["sampling"] = dataclasses.asdict(s.sampling)
    out["score"] = None if s.score is None else dataclasses.asdict(s.score)
    return out


def _sample_from_json(d: Mapping[str, Any], prompts: Mapping[int, Any]):
    if d["pid"] not in prompts:
        raise CheckpointError(f"sample {d['sid']} is of prompt {d['pid']}, which the dataset "
                              "no longer has")
    sampling = d["sampling"]
    sampling = Sampling(**{**sampling, "stop_token_ids": tuple(sampling["stop_token_ids"])})
    return Sample(int(d["sid"]), prompts[d["pid"]], int(d["batch"]), int(d["budget"]),
                  sampling, int(d["judge_budget"]), list(d["response"]), list(d["logprobs"]),
                  d["version"], list(d["judge_prompt"]), list(d["judgement"]),
                  None if d["score"] is None else Score(**d["score"]), d["state"],
                  int(d.get("group", -1)))   # -1: a checkpoint from before partial rollout


def _rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
