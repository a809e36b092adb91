"""rr_colocated as the paper ran it (Appendix E, issue 49): the shared pool rolls out one
batch, then judges it, then the next, while training runs on its own pool; the pooled
variant (`rr_colocated_pooled`) rolls out every admitted batch before judging any. Checked
on a simulated trace here and on a live one in test_run_paradigms (live_util.check_batch_cycle)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from live_util import assert_trace_ok, check_batch_cycle

from pivotrl_hpc.config import load_config
from pivotrl_hpc.controller.rl import Lengths, PromptData, RLBook
from pivotrl_hpc.sim.profile import H20
from pivotrl_hpc.sim.run import SimConstants, simulate
from pivotrl_hpc.sim.standin import stand_in
from pivotrl_hpc.trace import open_trace

ROOT = Path(__file__).resolve().parents[1]
GROUP = ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml"


def _simulated(paradigm: str, tmp_path: Path) -> tuple[dict, dict, dict]:
    """The 7B group's stand-ins at short lengths: 4 steps of 2 groups of 4, staleness 2; a
    training step of 30 s (at this batch the datasheet's is under a second, the paper's are
    tens of seconds), so that it overlaps the pool's next batch."""
    cfg, _ = stand_in(load_config(GROUP, [f"paradigm.name={paradigm}", "rl.steps=4",
                                          "rl.batch_size=2", "rl.group_size=4",
                                          "workload.rollout_median=300",
                                          "workload.genrm_median=200"],
                                  check_files=False), tmp_path)
    path = tmp_path / f"{paradigm}.h5"
    summary = simulate(cfg, replace(SimConstants.from_profile(cfg, H20), train_s=30.0), path)
    assert_trace_ok(path)
    with open_trace(str(path)) as t:
        return t.table("sequences"), t.table("steps"), summary


def test_simulated_rr_colocated_rolls_out_and_judges_one_batch_at_a_time(tmp_path):
    seq, steps, summary = _simulated("rr_colocated", tmp_path)
    assert summary["steps"] == 4 and len(steps["step"]) == 4
    times = check_batch_cycle(seq, steps)
    assert sorted(times) == [0, 1, 2, 3]


def test_the_pooled_variant_rolls_out_the_admitted_batches_before_judging(tmp_path):
    """With staleness 2 it admits batches 0-2 at once and rolls them all out first, so the
    per-batch check fails on it (the check can fail)."""
    seq, steps, summary = _simulated("rr_colocated_pooled", tmp_path)
    assert summary["steps"] == 4
    with pytest.raises(AssertionError, match="rollout started before batch 0 was judged"):
        check_batch_cycle(seq, steps)


def test_per_batch_admission_waits_for_the_batch_before_to_be_judged():
    """RLBook.admit(per_batch=True): batch b + 1 only once every sample of b is judged;
    staleness still bounds it; only the staleness bound counts as held."""
    lengths = Lengths("budget", 4, 0.1, 8, 4, 0.1, 8)
    prompts = [PromptData(i, (1, 2, 3), f"p{i}", "0") for i in range(8)]
    book = RLBook(prompts, steps=4, batch_size=2, group_size=2, staleness=2,
                  lengths=lengths, temperature=1.0)
    first = book.admit(0, 0.0, per_batch=True)
    assert [s.batch for s in first] == [0] * 4 and book.held_s == 0.0
    assert book.admit(0, 1.0, per_batch=True) == []

    class Judge:
        def judge_prompt(self, prompt, response):
            return [1]

        def score(self, prompt, response, judge):
            from pivotrl_hpc.task.types import Score
            return Score(0.0, 0.0, True)

    for s in first[:-1]:
        book.rolled(s.sid, [5], [-1.0], 0, Judge())
        book.rewarded(s.sid, [1], Judge())
    assert book.admit(0, 2.0, per_batch=True) == []    # one judgement of batch 0 left
    book.rolled(first[-1].sid, [5], [-1.0], 0, Judge())
    book.rewarded(first[-1].sid, [1], Judge())
    assert {s.batch for s in book.admit(0, 3.0, per_batch=True)} == {1}
    assert book.held_s == 0.0   # held by the cycle, not by staleness
    pooled = RLBook(prompts, steps=4, batch_size=2, group_size=2, staleness=2,
                    lengths=lengths, temperature=1.0)
    assert {s.batch for s in pooled.admit(0, 0.0)} == {0, 1, 2}   # k + 1 batches at once
