"""Validation (AIME-style) accuracy: pass@1 over rl.eval_samples samples of each validation
prompt, drawn at rl.eval_temperature, every rl.eval_every steps (modeled workers)."""
from __future__ import annotations

from controller_util import make_controller

from pivotrl_hpc.controller.rl import Lengths, RLBook, PromptData


def test_eval_samples_each_prompt_at_the_eval_temperature():
    lengths = Lengths("budget", 12, 0.8, 48, 6, 0.6, 16)
    prompts = [PromptData(-1 - i, (1, 2, 3), f"p{i}", "0") for i in range(3)]
    book = RLBook(prompts, steps=1, batch_size=1, group_size=2, staleness=0, lengths=lengths,
                  temperature=1.0, eval_samples=4, eval_temperature=0.6)
    samples = book.validation(prompts)
    assert [s.prompt.pid for s in samples] == [p.pid for p in prompts for _ in range(4)]
    assert {s.sampling.temperature for s in samples} == {0.6}
    assert len({s.sampling.seed for s in samples}) == 12
    greedy = RLBook(prompts, steps=1, batch_size=1, group_size=2, staleness=0,
                    lengths=lengths, temperature=1.0).validation(prompts)
    assert len(greedy) == 3 and {s.sampling.temperature for s in greedy} == {0.0}


def test_pass_at_1_is_over_every_sample_of_every_prompt():
    ctl, _ = make_controller("shiftable", eval_every=1)
    ctl.book.eval_samples, ctl.book.eval_temperature = 4, 1.0
    summary = ctl.run()
    n = len(ctl.validation) * 4                         # 4 prompts x 4 samples
    assert [v["step"] for v in summary["validation"]] == [1, 2, 3]
    for v in summary["validation"]:
        assert 0.0 <= v["accuracy"] <= 1.0 and (v["accuracy"] * n) % 1 == 0
    assert ctl.book.next_sid == 3 * 4 * 4 + 3 * n       # training + validation samples
