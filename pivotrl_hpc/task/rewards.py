"""Verifiable rewards (paper §8.1's R_DAPO) with veRL's `compute_score` signature.

`reward.verifiable` names one of:
- `dapo`: the DAPO recipe's rule: the text after the last "Answer:" of the response's last 300
  characters, normalised as Minerva does (Lewkowycz et al. 2022, appendix D), compared with
  the normalised ground truth as strings: +1 equal, -1 otherwise (no partial credit);
- `math_verify`: HuggingFace's math-verify (symbolic equivalence of the parsed answers), +1/-1;
- `module:function` or `path/to/file.py:function`: the user's own
  `compute_score(data_source, solution_str, ground_truth, extra_info)`, returning a number or a
  dict with a "score" (and optionally "acc"), as veRL calls it.
`load_scorer` imports it and calls it once on a dry sample, so a wrong name or signature stops
the job before any device starts.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl_hpc.task.errors import TaskError

KEY = "reward.verifiable"
TAIL_CHARS = 300   # DAPO scores the response's last 300 characters
ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalisation: textual substitutions, then units and LaTeX noise removed.
_SUBSTITUTE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
               ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
               ("\\text{m}", "\\text{}"))
_REMOVE = ("square ways integers dollars mph inches hours km units \\ldots sue points feet "
           "minutes digits cents degrees cm gm pounds meters meals edges students "
           "childrentickets multiples").split() + [
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots"]
_UNWRAP = (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})", r"(\\overline\{)(.*?)(\})",
           r"(\\boxed\{)(.*)(\})")


def normalize_final_answer(answer: str) -> str:
    """Minerva's answer normalisation (what DAPO compares)."""
    answer = answer.split("=")[-1]
    for old, new in _SUBSTITUTE:
        answer = answer.replace(old, new)
    for expr in _REMOVE:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for pattern in _UNWRAP:
        answer = re.sub(pattern, "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)   # \frac12 -> \frac{1}{2}
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_answer(solution: str) -> str | None:
    found = ANSWER.findall(solution[-TAIL_CHARS:])
    return normalize_final_answer(found[-1]) if found else None


def dapo_score(data_source: str, solution_str: str, ground_truth: str,
               extra_info: dict | None = None) -> dict[str, Any]:
    pred = dapo_answer(solution_str)
    acc = pred is not None and pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def math_verify_score(data_source: str, solution_str: str, ground_truth: str,
                      extra_info: dict | None = None) -> dict[str, Any]:
    from math_verify import parse, verify

    gold = parse(ground_truth if "$" in ground_truth else f"${ground_truth}$")
    acc = bool(gold) and bool(verify(gold, parse(solution_str)))
    return {"score": 1.0 if acc else -1.0, "acc": acc}


@dataclass(frozen=True)
class Verdict:
    score: float      # R_verifiable
    correct: bool     # for validation accuracy: "acc" where given, else score >= 1


class Scorer:
    """A loaded compute_score; `__call__` normalises what it returns."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name, self.fn = name, fn

    def __call__(self, data_source: str, solution: str, ground_truth: str,
                 extra_info: dict) -> Verdict:
        out = self.fn(data_source, solution, ground_truth, extra_info)
        if isinstance(out, dict):
            if "score" not in out:
                raise TaskError(KEY, f"{self.name} returned a dict without 'score' "
                                     f"(keys: {', '.join(map(str, out))})")
            score = out["score"]
            correct = bool(out["acc"]) if "acc" in out else None
        else:
            score, correct = out, None
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise TaskError(KEY, f"{self.name} returned {type(score).__name__} "
                                 f"{score!r}, not a number (or a dict with a numeric 'score')")
        return Verdict(float(score), correct if correct is not None else float(score) >= 1.0)


BUILTIN: dict[str, Callable[..., Any]] = {"dapo": dapo_score, "math_verify": math_verify_score}


def _import(spec: str) -> Callable[..., Any]:
    if spec == "math_verify":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise TaskError(KEY, "math_verify needs HuggingFace's math-verify package "
                                 "(pip install math-verify); or use dapo") from None
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise TaskError(KEY, f"{spec!r} is none of {', '.join(BUILTIN)} and not "
                             "module:function or path/to/file.py:function")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise TaskError(KEY, f"{spec}: {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(f"pivotrl_reward_{path.stem}",
                                                              path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import
        raise TaskError(KEY, f"{spec}: importing {where} failed: {type(e).__name__}: {e}"
                        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise TaskError(KEY, f"{spec}: {where} has no function {name!r}")
    return fn


def load_scorer(spec: str, dry: tuple[str, str, str, dict]) -> Scorer:
    """Import `spec` and call it once on the dry sample (data_source, a response, the
    ground truth, extra_info): a wrong signature or a bad return value stops here."""
    fn = _import(spec)
    try:
        inspect.signature(fn).bind(*dry)
    except TypeError as e:
        raise TaskError(KEY, f"{spec} cannot take compute_score(data_source, solution_str, "
                             f"ground_truth, extra_info): {e}") from None
    except ValueError:   # a builtin without a signature: the dry call below decides
        pass
    scorer = Scorer(spec, fn)
    try:
        scorer(*dry)
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's scorer may raise anything: named below
        raise TaskError(KEY, f"{spec} failed on a dry sample (data_source={dry[0]!r}, "
                             f"ground_truth={dry[2]!r}): {type(e).__name__}: {e}") from None
    return scorer
