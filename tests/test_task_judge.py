"""The GenRM's judgement (pivotrl_hpc.task.judge): each paper family's template and parser on
hand-written judgements in that family's style; thinking never decides a score."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl_hpc.task.errors import TaskError
from pivotrl_hpc.task.judge import FAMILIES, ParseRule, after_thinking, check_rule, fill, \
    last_boxed, parse_judgement, template_text

THOUGHT = ("Let me check. The reference says 42; the solution computes 6 * 7 = 42, "
           "so yes, no error. Maybe \\boxed{3}? No: the answer is right. ")

# (family, the prompt opens <think> itself, judgement text, expected (score, parsed, truncated))
CASES = [
    # GLM-Z1: its generation prompt may open <think>: the text starts inside the thinking
    ("glm-z1", True, THOUGHT + "</think>\nThe solution is correct.\n\\boxed{9}", (0.9, 1, 0)),
    ("glm-z1", True, THOUGHT + "still thinking, cut at the cap", (0.0, 0, 1)),
    ("glm-z1", True, THOUGHT + "</think>\nI cannot grade this.", (0.0, 0, 0)),
    ("glm-z1", False, "<think>" + THOUGHT + "</think>\n\\boxed{10}", (1.0, 1, 0)),
    # Qwen3 thinking mode: <think>...</think> then the boxed score
    ("qwen3", False, "<think>\n" + THOUGHT + "\n</think>\n\nScore: \\boxed{7}", (0.7, 1, 0)),
    ("qwen3", False, "<think>\n" + THOUGHT, (0.0, 0, 1)),
    ("qwen3", False, "<think>\n" + THOUGHT + "</think>\n\\boxed{85}", (0.0, 0, 0)),  # > 10
    ("qwen3", False, "<think>\n\n</think>\n\n\\boxed{ 4.5 }", (0.45, 1, 0)),  # thinking off
    # Qwen3.5: thinks, then a verdict line
    ("qwen3.5", False, "<think>" + THOUGHT + "</think>\nVerdict: no", (0.0, 1, 0)),
    ("qwen3.5", False, "<think>" + THOUGHT + "</think>\nVerdict: yes", (1.0, 1, 0)),
    ("qwen3.5", False, "<think>" + THOUGHT, (0.0, 0, 1)),
    ("qwen3.5", False, "<think>" + THOUGHT + "</think>\nHard to say.", (0.0, 0, 0)),
    ("tiny", False, "yes", (1.0, 1, 0)),
    ("tiny", False, "ok ok", (0.0, 0, 0)),
]


# Held-out-style yes/no verdicts (issue 48, written as a GenRM writes them, not tuned to the
# rule): -> the score, or None where the rule must refuse (counted unparsed). The old rule
# took the last yes/no word anywhere after </think>: it read the first three the wrong way.
VERDICTS = [
    ("The final answer 12 is not correct.", 0.0),
    ("The solution is correct, with no errors.", 1.0),
    ("Verdict: no\n(Yes, I am sure.)", 0.0),
    ("Verdict: no (Yes, I am sure.)", 0.0),
    ("**Verdict:** Yes", 1.0),
    ("The reasoning has a slip, but the answer matches.\nVerdict: yes", 1.0),
    ("The answer isn't correct: 7 * 8 is 56.", 0.0),
    ("Verdict: not correct", 0.0),
    ("Verdict: yes\nOn reflection:\nVerdict: no", 0.0),           # the last verdict line
    ("It is correct. No, wait: incorrect.", None),                   # says both: refuse
    ("There are no errors in the arithmetic.", None),                # no verdict at all
    ("Verdict: unclear", None),
    ("Verdict: not incorrect", None),
    ("Incorrect.", 0.0),
    ("No.", 0.0),
]


@pytest.mark.parametrize("text,score", VERDICTS)
def test_yes_no_verdicts_read_negations_or_refuse(text, score):
    for family in ("qwen3.5", "tiny"):
        got = parse_judgement("<think>Maybe yes. Maybe not.</think>\n" + text,
                              FAMILIES[family].rule)
        assert (got.score, got.parsed) == ((score, True) if score is not None else (0.0, False))


@pytest.mark.parametrize("family,opened,text,expected", CASES)
def test_each_family_parses_its_judgements(family, opened, text, expected):
    got = parse_judgement(text, FAMILIES[family].rule, opened)
    assert (got.score, got.parsed, got.truncated) == pytest.approx(
        (expected[0], bool(expected[1]), bool(expected[2])))


def test_the_default_stands_in_for_an_unparsed_judgement():
    rule = ParseRule("boxed", 0.1, default=0.5)
    assert parse_judgement("<think>cut", rule).score == 0.5
    assert parse_judgement("no score", rule).score == 0.5


def test_each_family_template_has_the_placeholders_and_fills_only_them():
    for name in FAMILIES:
        text = template_text(name)
        assert all(k in text for k in ("{problem}", "{response}", "{ground_truth}")), name
    filled = fill(template_text("qwen3"), "P?", "R.", "42")
    assert "\\boxed{score}" in filled and "P?" in filled and "{response}" not in filled


def test_regex_rule_and_bad_rules():
    rule = ParseRule("regex", 0.01, r"(\d+)\s*%")
    assert parse_judgement("<think>99 %</think> I give it 80 %", rule).score == 0.8
    with pytest.raises(TaskError, match="is empty"):
        check_rule(ParseRule("regex", 1.0, ""))
    with pytest.raises(TaskError, match="unterminated"):
        check_rule(ParseRule("regex", 1.0, "(oops"))
    with pytest.raises(TaskError, match="not one of boxed, yesno, regex"):
        check_rule(ParseRule("stars"))


def test_a_template_file_needs_a_response_placeholder(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("Grade {problem}")
    with pytest.raises(TaskError, match=r"no \{response\} placeholder"):
        template_text(str(f))
    with pytest.raises(TaskError, match="neither a template file nor a GenRM family"):
        template_text(str(tmp_path / "absent.txt"))


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{7") is None and last_boxed("none") is None


TEXT = st.text(st.sampled_from("ab yes no Verdict: \\boxed{}0123456789.\n%<>/think"),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(thought=TEXT, answer=TEXT, family=st.sampled_from(sorted(FAMILIES)))
def test_text_inside_thinking_never_decides_a_score(thought, answer, family):
    """For any thinking and any answer after it, the judgement is the answer's alone: the
    same as the answer with other thinking, or with none."""
    thought = thought.replace("</think>", "")
    answer = answer.replace("<think>", "").replace("</think>", "")
    rule = FAMILIES[family].rule
    alone = parse_judgement(answer, rule)
    for opened in (False, True):
        for think in (thought, "yes \\boxed{10} Verdict: yes", "no \\boxed{0}"):
            text = ("" if opened else "<think>") + think + "</think>" + answer
            assert parse_judgement(text, rule, opened) == alone
    # and thinking that never closes scores the default, whatever it says
    assert parse_judgement("<think>" + thought, rule) == parse_judgement("<think>", rule)
    assert after_thinking("<think>" + thought) is None


def test_the_config_knows_the_families_the_judge_has():
    """config checks reward.genrm_template against its own list of family names (config
    imports no task module): it is the judge's."""
    from pivotrl_hpc.config.schema import GENRM_FAMILIES

    assert GENRM_FAMILIES == tuple(FAMILIES)
