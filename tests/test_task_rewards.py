"""Verifiable rewards (pivotrl_hpc.task.rewards): DAPO's rule, math-verify, the user's own
compute_score loaded and dry-called before any device starts."""
from __future__ import annotations

import pytest

from pivotrl_hpc.task.arithmetic import compute_score as arithmetic
from pivotrl_hpc.task.errors import TaskError
from pivotrl_hpc.task.rewards import dapo_score, load_scorer, normalize_final_answer

DRY = ("math_dapo", "Answer: 0", "42", {})


@pytest.mark.parametrize("solution,truth,score", [
    ("2 + 40 = 42\nAnswer: 42", "42", 1.0),
    ("Answer: 41\nno wait\nAnswer: 42", "42", 1.0),         # the last Answer: decides
    ("Answer: 42\nlater: Answer: 7", "42", -1.0),
    ("answer : $42$", "42", 1.0),                            # case, spaces, math mode
    ("Answer: \\boxed{42}", "42", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: 42 degrees", "42", 1.0),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("The result is 42.", "42", -1.0),                       # no "Answer:" line: -1
    ("Answer: 42" + "x" * 400, "42", -1.0),                  # beyond the last 300 characters
    ("", "42", -1.0),
])
def test_dapo_rule(solution, truth, score):
    got = dapo_score("math_dapo", solution, truth)
    assert got["score"] == score and got["acc"] == (score == 1.0)


def test_minerva_normalisation():
    assert normalize_final_answer("x = \\text{5 apples}") == "5apples"
    assert normalize_final_answer("$\\sqrt2$") == "\\sqrt{2}"
    assert normalize_final_answer(" 12,345 ") == "12345"


def test_math_verify_when_installed():
    pytest.importorskip("math_verify")
    scorer = load_scorer("math_verify", DRY)
    assert scorer("math_dapo", "so the answer is $\\frac{1}{2}$", "0.5", {}).score == 1.0
    assert scorer("math_dapo", "so the answer is $\\frac{1}{3}$", "0.5", {}).score == -1.0


def test_the_arithmetic_task_is_one_compute_score():
    scorer = load_scorer("pivotrl_hpc.task.arithmetic:compute_score", DRY)
    assert scorer("", "the sum is 42", "42", {}).correct
    half = scorer("", "ab12", "7", {})
    assert half.score == pytest.approx(0.5) and not half.correct
    assert arithmetic("", "", "1") == {"score": 0.0, "acc": False}


def test_a_compute_score_file_with_the_verl_signature(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return 1.0 if ground_truth in solution_str else 0.0\n")
    scorer = load_scorer(f"{f}:compute_score", DRY)
    v = scorer("s", "it is 42", "42", {})
    assert v.score == 1.0 and v.correct


@pytest.mark.parametrize("body,spec,match", [
    ("", "nosuchmodule_xyz:compute_score", "importing nosuchmodule_xyz failed: "
                                           "ModuleNotFoundError"),
    ("def other(a, b, c, d): return 0\n", "{f}:compute_score", "has no function "
                                                               "'compute_score'"),
    ("def compute_score(solution_str, ground_truth): return 0\n", "{f}:compute_score",
     r"cannot take compute_score\(data_source, solution_str, ground_truth, extra_info\)"),
    ("def compute_score(a, b, c, d): return 'yes'\n", "{f}:compute_score",
     "returned str 'yes', not a number"),
    ("def compute_score(a, b, c, d): return {'acc': True}\n", "{f}:compute_score",
     "returned a dict without 'score'"),
    ("def compute_score(a, b, c, d): return 1 / 0\n", "{f}:compute_score",
     "failed on a dry sample .*ZeroDivisionError"),
    ("raise RuntimeError('boom')\n", "{f}:compute_score", "RuntimeError: boom"),
    ("", "{missing}:compute_score", "does not exist"),
    ("", "no_colon", "is none of dapo, math_verify"),
])
def test_a_bad_compute_score_stops_with_the_reason(tmp_path, body, spec, match):
    f = tmp_path / "r.py"
    f.write_text(body)
    spec = spec.format(f=f, missing=tmp_path / "absent.py")
    with pytest.raises(TaskError, match=match) as e:
        load_scorer(spec, DRY)
    assert e.value.key == "reward.verifiable"
