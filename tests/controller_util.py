"""A controller over modeled workers on virtual time (pivotrl_hpc.sim.modeled), for tests."""
from __future__ import annotations

import os
from unittest import mock

from pivotrl_hpc.controller.clock import VirtualClock
from pivotrl_hpc.controller.handles import Devices
from pivotrl_hpc.controller.loop import Controller, LoopConfig
from pivotrl_hpc.controller.monitor import RoleModel
from pivotrl_hpc.controller.policy import TauTracker
from pivotrl_hpc.controller.rl import Lengths, PromptData, RLBook, Score
from pivotrl_hpc.plan.policies import PLANNERS, make_policy
from pivotrl_hpc.plan.types import ReplicaSpec, ShiftPlan
from pivotrl_hpc.sched.model import ThroughputModel
from pivotrl_hpc.sim.modeled import ModeledStore, ModeledWorker

POLICY = ThroughputModel(2e-6, 0.004, 4e-4, 0.002)
GENRM = ThroughputModel(4e-6, 0.008, 6e-4, 0.004)


class ToyTask:
    """Judge prompt = prompt + the first response tokens; score from the token values."""

    def judge_prompt(self, prompt, response):
        return list(prompt.prompt_ids) + list(response[:4])

    def score(self, prompt, response, judge):
        parsed = bool(judge) and judge[0] % 5 != 0
        return Score(float(response[0] % 2 == 0), (judge[0] % 10) / 9 if parsed else 0.0,
                     parsed)

    def correct(self, prompt, response):
        return response[0] % 2 == 0


def prompts(n=64):
    return [PromptData(i, tuple(range(1, 6 + i % 5)), f"p{i}", "0") for i in range(n)]


def make_controller(paradigm="shiftable", gpus=8, train=(0, 1, 2, 3), steps=3, staleness=2,
                    params=None, bootstrap=None, reward_gpus=1, fail_on=None, eval_every=0,
                    trace=None, batch_size=4, group_size=4, tau=None, late_finish=False,
                    prebuild=()):
    clock = VirtualClock()
    store = ModeledStore()
    # a failure injected through the one test-only fault hook, read as the workers are made
    faults = {"PIVOTRL_TEST_FAULTS": f"modeled_{fail_on.__name__}=1"} if fail_on else {}
    with mock.patch.dict(os.environ, faults):
        workers = [ModeledWorker(d, clock, store, {"policy": POLICY, "genrm": GENRM},
                                 {"rollout": 0.5, "reward": 0.6, "training": 0.8},
                                 {"rollout": 0.3, "reward": 0.3, "training": 0.4},
                                 late_finish=late_finish) for d in range(gpus)]
    lengths = Lengths("budget", 12, 0.8, 48, 6, 0.6, 16)
    book = RLBook(prompts(), steps=steps, batch_size=batch_size, group_size=group_size,
                  staleness=staleness, lengths=lengths, temperature=1.0, seed=0)
    cfg = LoopConfig(gpus, {"rollout": 1, "reward": reward_gpus},
                     {"rollout": 2048, "reward": 2048}, tuple(train), steps,
                     planner_interval_s=0.5, log_interval_s=1.0, eval_every=eval_every,
                     prebuild=tuple(prebuild))
    models = {"rollout": RoleModel(POLICY, True), "reward": RoleModel(GENRM, True)}
    tau = TauTracker(dict(tau or {"rollout": 0.8, "reward": 0.9, "training": 1.2}))
    policy = make_policy(paradigm, params or ({"tau_shift": dict(tau.tau)} if paradigm in PLANNERS
        else {}))
    tau.attach(policy)
    ctl = Controller(cfg, clock, Devices(workers), policy, book, ToyTask(), models, tau,
                     trace, validation=prompts(8)[:4], bootstrap=bootstrap)
    return ctl, workers


def split_bootstrap(rollout=(4, 5), reward=(6, 7)):
    ups = [ReplicaSpec("rollout", (d,)) for d in rollout]
    ups += [ReplicaSpec("reward", (d,)) for d in reward]
    return ShiftPlan((), tuple(ups), "initial allocation")
