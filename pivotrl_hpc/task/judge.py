"""The GenRM's judgement (paper §8.1, R_GenRM): judge prompt from a template file, score
parsed from the generated text.

The template (`reward.genrm_template`: a family name below, or a file) holds `{problem}`,
`{response}` and `{ground_truth}`; the filled text is the user turn, rendered through the GenRM
tokenizer's chat template (`enable_thinking` where the template takes it). Parsing skips the
thinking: the score is read only after the last `</think>`; thinking that never closes (the
judgement was cut at its cap, or the prompt opened `<think>` and the model never left it) is
truncated. The rule: `boxed` (the last \\boxed{x}, x numeric, times `reward.genrm_scale`),
`yesno` (the verdict, see `yes_no`), or `regex` (the last match's first group, numeric,
times the scale). A judgement with no score, or a score outside [0, 1] after scaling, gets
`reward.genrm_default` and is counted as unparsed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pivotrl_hpc.task.errors import TaskError

THINK, END_THINK = "<think>", "</think>"
RULES = ("boxed", "yesno", "regex")
PLACEHOLDERS = ("{problem}", "{response}", "{ground_truth}")


@dataclass(frozen=True)
class ParseRule:
    kind: str = "boxed"
    scale: float = 0.1
    regex: str = ""
    default: float = 0.0


@dataclass(frozen=True)
class Family:
    """One paper GenRM family's template file and the rule that reads its judgements."""
    template: str
    rule: ParseRule


FAMILIES: dict[str, Family] = {
    # GLM-Z1-9B: reasons (its chat template opens <think> itself), then a boxed 0-10 score
    "glm-z1": Family("glm-z1.txt", ParseRule("boxed", 0.1)),
    # Qwen3-30B-A3B in thinking mode: <think>...</think>, then a boxed 0-10 score
    "qwen3": Family("qwen3.txt", ParseRule("boxed", 0.1)),
    # Qwen3.5-122B-A10B: thinks, then a one-word verdict line
    "qwen3.5": Family("qwen3.5.txt", ParseRule("yesno", 1.0)),
    # the tiny CPU GenRM (warm-started by init-models to answer yes or no)
    "tiny": Family("tiny.txt", ParseRule("yesno", 1.0)),
}


@dataclass(frozen=True)
class Judgement:
    score: float
    parsed: bool        # False: no score found (or out of range): `default` stands in
    truncated: bool     # the thinking never closed


def template_text(spec: str) -> str:
    """A family's packaged template, or the file `spec` names; checked for {response}."""
    if spec in FAMILIES:
        text = (resources.files("pivotrl_hpc.task") / "templates" /
                FAMILIES[spec].template).read_text(encoding="utf-8")
    else:
        path = Path(spec)
        if not path.is_file():
            raise TaskError("reward.genrm_template",
                            f"{spec} is neither a template file nor a GenRM family "
                            f"({', '.join(FAMILIES)})")
        text = path.read_text(encoding="utf-8")
    if "{response}" not in text:
        raise TaskError("reward.genrm_template", f"{spec} has no {{response}} placeholder "
                                                 "(the policy's response goes there)")
    return text


def fill(template: str, problem: str, response: str, ground_truth: str) -> str:
    """Replace the three placeholders only (a template's other braces, e.g. \\boxed{}, stay)."""
    out = template
    for key, value in zip(PLACEHOLDERS, (problem, response, ground_truth)):
        out = out.replace(key, value)
    return out


def after_thinking(text: str, opened: bool = False) -> str | None:
    """The text after the last </think>; None when thinking never closed (truncated).
    `opened`: the prompt itself ended inside <think> (GLM-Z1's template does)."""
    if END_THINK in text:
        return text.rsplit(END_THINK, 1)[1]
    if opened or THINK in text:
        return None
    return text


# The templates' verdict line ("Verdict: yes"), the last one; markdown around it allowed.
_VERDICT_LINE = re.compile(r"^[\W_]*verdict[\W_]*:(.*)$", re.IGNORECASE | re.MULTILINE)
# A verdict word, with a negation before it. "no" counts only as an answer on its own
# ("No.", "no,", "no" at the end), not as a determiner ("no errors").
_WORD = re.compile(r"(?:\b(not|never|isn'?t|wasn'?t|aren'?t|n't)\s+)?"
                   r"\b(yes|correct|incorrect|no(?![ \t]*[a-z]))\b", re.IGNORECASE)
_NUMBER = re.compile(r"\s*([-+]?\d+(?:\.\d+)?)\s*")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None if none closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _number(raw: str | None, scale: float) -> float | None:
    m = _NUMBER.fullmatch(raw) if raw is not None else None
    return float(m.group(1)) * scale if m else None


def _reading(negation: str, word: str) -> float | None:
    positive = word.lower() in ("yes", "correct")
    if negation and not positive:
        return None   # "not incorrect", "not no": no verdict a rule should guess
    return float(positive and not negation)


def polarity(text: str) -> float | None:
    """1.0 or 0.0 when every verdict word of `text` says the same (negations read: "not
    correct" is 0, "correct, with no errors" is 1); None when none does or they disagree."""
    said = {_reading(*m) for m in _WORD.findall(text)}
    return said.pop() if len(said) == 1 else None


def yes_no(answer: str) -> float | None:
    """The last "Verdict:" line's first verdict word decides, whatever follows ("Verdict:
    no ... (Yes, I am sure.)" is 0); without such a line, the whole answer if it says one
    thing; else None (unparsed)."""
    lines = _VERDICT_LINE.findall(answer)
    if not lines:
        return polarity(answer)
    first = _WORD.search(lines[-1])
    return _reading(*first.groups(default="")) if first else None


def raw_score(answer: str, rule: ParseRule) -> float | None:
    if rule.kind == "boxed":
        return _number(last_boxed(answer), rule.scale)
    if rule.kind == "yesno":
        return yes_no(answer)
    found = list(re.finditer(rule.regex, answer))
    if not found:
        return None
    last = found[-1]
    return _number(last.group(1) if last.re.groups else last.group(0), rule.scale)


def parse_judgement(text: str, rule: ParseRule, opened: bool = False) -> Judgement:
    answer = after_thinking(text, opened)
    if answer is None:
        return Judgement(rule.default, False, True)
    score = raw_score(answer, rule)
    if score is None or not 0.0 <= score <= 1.0:
        return Judgement(rule.default, False, False)
    return Judgement(score, True, False)


def check_rule(rule: ParseRule) -> None:
    if rule.kind not in RULES:
        raise TaskError("reward.genrm_parse", f"{rule.kind!r} is not one of {', '.join(RULES)}")
    if rule.kind == "regex":
        try:
            re.compile(rule.regex)
        except re.error as e:
            raise TaskError("reward.genrm_regex", f"{rule.regex!r}: {e}") from None
        if not rule.regex:
            raise TaskError("reward.genrm_regex", "is empty; the regex rule needs a pattern "
                                                  "whose first group is the score")
    if not rule.scale > 0:
        raise TaskError("reward.genrm_scale", f"{rule.scale!r} must be > 0")
