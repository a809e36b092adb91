"""Partial rollout within the staleness bound (sched/partial.py, paradigm.partial_rollout),
the admission lever beyond the paper: which groups form a step, the lag never above k, and
on a simulated trace the option changes what it claims while `trace check` holds."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from lever_util import check_ablation
from live_util import assert_trace_ok

from pivotrl_hpc.config import load_config
from pivotrl_hpc.controller.rl import Lengths, PromptData, RLBook, Score, lag
from pivotrl_hpc.sched.partial import Group, deadline, feasible, form_batch

ROOT = Path(__file__).resolve().parents[1]
GROUP = ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml"


def test_a_step_takes_the_complete_groups_due_first_in_admission_order():
    groups = [Group(0, 2, False), Group(1, 2, True), Group(2, 2, True), Group(3, 3, True),
              Group(4, 2, True)]
    assert form_batch(groups, 0, 2) == [1, 2]
    assert form_batch(groups, 0, 3) == [1, 2, 4]
    # a later deadline fills only what the earlier ones leave
    assert form_batch(groups, 0, 4) == [1, 2, 3, 4]


def test_a_step_waits_for_a_group_due_now_or_for_enough_complete_ones():
    assert form_batch([Group(0, 1, False), Group(1, 2, True), Group(2, 2, True)], 1, 1) is None
    assert form_batch([Group(0, 2, True), Group(1, 2, False)], 0, 2) is None
    assert form_batch([Group(0, 1, True), Group(1, 2, False)], 1, 1) == [0]


def test_a_step_waits_rather_than_leave_a_later_step_more_than_it_can_train():
    # step 0 of size 1 could train group 2, but groups 0 and 1 are both due by step 1
    groups = [Group(0, 1, False), Group(1, 1, False), Group(2, 2, True)]
    assert not feasible(groups[:2], 0, 1)
    assert form_batch(groups, 0, 1) is None
    assert form_batch([*groups[:1], Group(1, 1, True), groups[2]], 0, 1) == [1]


def test_a_broken_deadline_or_count_is_an_error_not_a_wait():
    with pytest.raises(ValueError, match="past their deadline"):
        form_batch([Group(0, 0, True), Group(1, 2, True)], 1, 1)
    with pytest.raises(ValueError, match="more than 1 groups due"):
        form_batch([Group(0, 1, True), Group(1, 1, True)], 1, 1)
    assert deadline(3, 2) == 5


class Task:
    def judge_prompt(self, prompt, response):
        return [1]

    def score(self, prompt, response, judge):
        return Score(1.0, 1.0, True)


def book(partial: bool, staleness: int = 2, batch_size: int = 2) -> RLBook:
    prompts = [PromptData(i, (1, 2, 3), f"p{i}", "0") for i in range(5)]
    return RLBook(prompts, steps=6, batch_size=batch_size, group_size=2, staleness=staleness,
                  lengths=Lengths("budget", 4, 0.1, 8, 4, 0.1, 8), temperature=1.0,
                  partial=partial)


def finish(b: RLBook, s, version: int) -> None:
    b.rolled(s.sid, [5], [-0.1], version, Task())
    b.rewarded(s.sid, [7], Task())


def test_the_book_forms_step_0_from_whichever_groups_finished_first():
    for partial, deadlines in ((False, [0, 0, 1, 1, 2, 2]), (True, [2] * 6)):
        b = book(partial)
        admitted = b.admit(0, 0.0)
        assert [s.batch for s in admitted[::2]] == deadlines   # two samples a group
        for s in admitted:
            if s.group in (3, 5):
                finish(b, s, 0)
        assert b.batch_ready(0) is partial
        if partial:
            formed = b.form(0)
            assert sorted({s.group for s in formed}) == [3, 5] and len(formed) == 4
            assert {s.batch for s in formed} == {0} and b.group_ids(formed) == (3, 3, 5, 5)
            assert [lag(s) for s in b.trained(0)] == [0] * 4
            assert not b.batch_ready(1)   # groups 0-2 and 4 are not judged yet


def test_lag_never_exceeds_k_whatever_order_the_groups_finish_in():
    """A run of the book: groups finish in a random order, a step trains when it can, the
    version advances with it; every group trains once, a step holds batch_size groups, and
    no sample's lag is above k."""
    for seed in range(20):
        rng = random.Random(seed)
        k = rng.choice((0, 1, 2, 3))
        b, version, trained = book(True, k, rng.choice((1, 2, 3))), 0, []
        open_: list = []
        while len(trained) < b.steps:
            open_ += b.admit(version, 0.0)
            rng.shuffle(open_)
            for s in open_[:rng.randint(1, 4)]:
                finish(b, s, version)
            open_ = [s for s in open_ if s.state == "admitted"]
            step = len(trained)
            if b.batch_ready(step):
                b.form(step)
                got = b.trained(step)
                assert len(got) == b.batch_size * b.group_size
                assert max(lag(s) for s in got) <= k, (seed, step)
                trained.append({s.group for s in got})
                version += 1
        assert sorted(g for t in trained for g in t) == list(range(b.steps * b.batch_size))


def _simulated(partial: bool, tmp_path: Path, paradigm: str = "shiftable"):
    from pivotrl_hpc.sim.profile import H20
    from pivotrl_hpc.sim.run import SimConstants, simulate
    from pivotrl_hpc.sim.standin import stand_in
    from pivotrl_hpc.trace import open_trace

    cfg, _ = stand_in(load_config(GROUP, [
        f"paradigm.name={paradigm}", "rl.steps=5", "rl.batch_size=2", "rl.group_size=4",
        "workload.rollout_median=300", "workload.genrm_median=200",
        f"paradigm.partial_rollout={str(partial).lower()}"], check_files=False), tmp_path)
    path = tmp_path / f"{paradigm}_partial_{partial}.h5"
    simulate(cfg, replace(SimConstants.from_profile(cfg, H20), train_s=30.0), path)
    assert_trace_ok(path)
    with open_trace(str(path)) as t:
        return t.table("sequences"), t.table("steps")


def test_simulated_partial_rollout_trains_finished_groups_early_within_the_bound(tmp_path):
    """The 7B group's stand-ins at short lengths, 5 steps of 2 groups of 4, staleness 2:
    the paper's step 0 trains prompts 0-1 (their samples 0-7); with the lever it trains the
    first two groups to finish among the three batches admitted at v0, ends earlier, and
    `trace check` (lag <= k at admission and at training) holds on both."""
    paper_seq, paper = _simulated(False, tmp_path)
    seq, steps = _simulated(True, tmp_path)
    first = [sid for _, sid in paper["prompts"][0]]
    assert first == list(range(8))
    ours = sorted(sid for _, sid in steps["prompts"][0])
    assert ours != first and len(ours) == 8
    assert steps["t"][0] < paper["t"][0]
    assert max(steps["max_lag"]) <= 2 and len(steps["step"]) == 5
    # the three batches admitted against v0 are all due at step 2 (the paper: 0, 1, 2)
    assert set(_admitted(seq)[:24]) == {2}
    assert sorted(set(_admitted(paper_seq)[:24])) == [0, 1, 2]


@pytest.mark.parametrize("paradigm", ["colocated", "disaggregated", "rr_colocated"])
def test_every_paradigm_keeps_the_bound_with_partial_rollout(tmp_path, paradigm):
    """The option is the book's, under every paradigm's policy: all steps train, `trace
    check` holds (lag <= k at admission and at training)."""
    _, steps = _simulated(True, tmp_path, paradigm)
    assert len(steps["step"]) == 5 and max(steps["max_lag"]) <= 2
    assert list(steps["samples"]) == [8] * 5


def _admitted(seq) -> list[int]:
    """Each rollout admission's step (partial rollout: the group's deadline), in order."""
    text = [[x.decode() if isinstance(x, bytes) else x for x in seq[c]]
            for c in ("event", "role")]
    return [int(s) for e, r, s in zip(*text, seq["step"]) if e == "admit" and r == "rollout"]


def test_reproduce_partial_runs_pivotrl_as_the_paper_and_with_the_lever_per_group(
        monkeypatch, tmp_path):
    """`pivotrl reproduce --only partial`: per group, shiftable on the same seeds with and
    without the lever, the ratio over the paper's, the summary line and the plot (the runs'
    figures given, nothing simulated)."""
    import argparse

    from pivotrl_hpc.cli.reproduce import FIGURES, add_arguments
    from pivotrl_hpc.reproduce.experiments import Lab, Scale
    from pivotrl_hpc.reproduce.runs import Outcome

    lever, made = "paradigm.partial_rollout=true", []

    def run_all(runs):
        made.extend(runs)
        return [Outcome(r, {"processed_tokens_per_s": (1200.0 if lever in r.overrides
                                                       else 1000.0) + r.seed}) for r in runs]
    lab = Lab(ROOT / "configs", Scale(steps=2, seeds=2))
    monkeypatch.setattr(lab, "_all", run_all)
    got = lab.partial()
    assert "partial" in FIGURES
    check_ablation(got, made, "partial", lever, 1200.0, tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)   # named only: a whole reproduce does not run it
    assert "partial" not in parser.parse_args([]).only.split(",")
