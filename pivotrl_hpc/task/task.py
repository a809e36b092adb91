"""The RL task the controller runs: prompts from the configured data, rendered by the policy's
chat template; R = R_verifiable + R_GenRM (paper §8.1) from the configured compute_score and
the GenRM's parsed judgement. Token ids in, token ids and scores out (the controller's `Task`).

Everything that can be wrong with the task (a data file, a key path, a chat template, a
compute_score, a judge template that does not fit) raises TaskError when the task is built, and
the launch's preflight (launch/preflight.py) builds it before any worker starts.
"""
from __future__ import annotations

import copy
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence

from pivotrl_hpc.config.schema import Config
from pivotrl_hpc.task import data as D
from pivotrl_hpc.task.errors import RewardFunctionError, TaskError
from pivotrl_hpc.task.judge import FAMILIES, ParseRule, check_rule, fill, parse_judgement, \
    template_text
from pivotrl_hpc.task.prompts import ChatRenderer
from pivotrl_hpc.task.rewards import Verdict, load_scorer
from pivotrl_hpc.task.types import PromptData, Score

log = logging.getLogger(__name__)

VALIDATION_PID = -1   # validation prompt of row r: pid -1 - r (never a training row's)
TEXTS_KEPT = 8192     # response texts kept between judge_prompt and score (RLTask.text)


def parse_rule(cfg: Config) -> ParseRule:
    r = cfg.reward
    family = FAMILIES.get(r.genrm_template)
    base = family.rule if family else ParseRule("boxed", 0.1)
    rule = ParseRule(base.kind if r.genrm_parse == "auto" else r.genrm_parse,
                     r.genrm_scale or base.scale, r.genrm_regex, r.genrm_default)
    check_rule(rule)
    return rule


class RLTask:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.policy = ChatRenderer(cfg.models.policy.path, cfg.data.chat_template,
                                   key="models.policy.path")
        self.genrm = ChatRenderer(cfg.models.genrm.path, cfg.data.chat_template,
                                  cfg.reward.genrm_thinking, key="models.genrm.path")
        self.template = template_text(cfg.reward.genrm_template)
        self.rule = parse_rule(cfg)
        self.records: dict[int, D.Record] = {}
        self._texts: OrderedDict[tuple[int, ...], str] = OrderedDict()   # text(): ids -> text
        self.filtered: dict[str, int] = {}      # split -> overlong prompts dropped
        self.reward_errors = 0   # responses the reward function raised on (on_error: default)
        self.opens_thinking = self.genrm.text(
            [{"role": "user", "content": "x"}]).rstrip().endswith("<think>")
        self.judge_overhead = len(self.genrm.ids([{"role": "user", "content": fill(
            self.template, "", "", "")}]))
        self.max_judge = cfg.models.genrm.max_prompt_len
        if self.judge_overhead >= self.max_judge:
            raise TaskError("models.genrm.max_prompt_len",
                            f"{self.max_judge}: the judge template "
                            f"({cfg.reward.genrm_template}) alone renders to "
                            f"{self.judge_overhead} tokens; raise it")

    # --- data ------------------------------------------------------------------------------
    def records_of(self, split: str) -> list[D.Record]:
        d = self.cfg.data
        key = f"data.{split}"
        try:
            if d.format == "synthetic":
                n = d.synthetic_train if split == "train" else d.synthetic_validation
                return D.synthetic(split, self.cfg.rl.seed, n)
            path = getattr(d, split)
            if not path:
                raise TaskError(key, "is empty; name a parquet or JSONL file, or set "
                                     "data.format: synthetic")
            return D.read_records(path, d.format, D.DataKeys(d.prompt_key, d.answer_key,
                                                             d.on_bad_line))
        except D.DatasetError as e:
            raise TaskError(key, str(e)) from None

    def load(self, split: str, limit: int | None = None) -> list[PromptData]:
        """The split's prompts, rendered; overlong ones filtered (counted) or rejected. A
        prompt is overlong past models.policy.max_prompt_len, or when its judge prompt with
        an empty response is past models.genrm.max_prompt_len (it could never be judged)."""
        out, dropped = [], []
        for rec in self.records_of(split)[:limit]:
            ids = self.policy.ids(rec.chat())
            over = self._overlong(rec, len(ids))
            if over:
                if self.cfg.data.overlong == "reject":
                    raise TaskError(f"data.{split}", f"{self._where(split)} row {rec.row}: "
                                    f"{over} (data.overlong: filter drops such prompts)")
                dropped.append(rec.row)
                continue
            pid = rec.row if split == "train" else VALIDATION_PID - rec.row
            self.records[pid] = rec
            out.append(PromptData(pid, tuple(ids), rec.problem, rec.answer, rec.data_source))
        self.filtered[split] = len(dropped)
        caps = (f"models.policy.max_prompt_len={self.cfg.models.policy.max_prompt_len} or "
                f"models.genrm.max_prompt_len={self.max_judge}")
        if dropped:
            log.warning("%s: %d of %d prompts are longer than %s tokens and were left out "
                        "(first: row %d)", self._where(split), len(dropped),
                        len(dropped) + len(out), caps, dropped[0])
        if not out:
            raise TaskError(f"data.{split}", f"{self._where(split)}: no prompt fits {caps}")
        return out

    def _overlong(self, rec: D.Record, n: int) -> str | None:
        cap = self.cfg.models.policy.max_prompt_len
        if n > cap:
            return f"the rendered prompt has {n} tokens, over models.policy.max_prompt_len={cap}"
        judge = len(self._judge_ids(rec, ""))
        if judge > self.max_judge:
            return (f"its judge prompt has {judge} tokens before any response, over "
                    f"models.genrm.max_prompt_len={self.max_judge}")
        return None

    def _where(self, split: str) -> str:
        return "the synthetic set" if self.cfg.data.format == "synthetic" else \
            getattr(self.cfg.data, split)

    def training_order(self, prompts: list[PromptData]) -> list[PromptData]:
        """The prompts of every step, reshuffled each pass with the run's seed."""
        rl = self.cfg.rl
        return D.epochs(prompts, rl.seed, rl.steps * rl.batch_size)

    # --- reward ----------------------------------------------------------------------------
    def dry_check(self, prompt: PromptData) -> None:
        """Load compute_score and call it once, on the first prompt's row."""
        rec = self.records[prompt.pid]
        self.scorer = load_scorer(self.cfg.reward.verifiable,
                                  (rec.data_source, "Answer: 0", rec.answer, rec.extra_info))

    def text(self, response_ids: Sequence[int]) -> str:
        """The response's text, kept between `judge_prompt` and `score` (one decode a
        response instead of two; `score` lets it go). Keyed by the tokens themselves; past
        TEXTS_KEPT the least recently used goes (a response never scored, or one decoded
        again at its score: slower, never wrong)."""
        key = tuple(response_ids)
        text = self._texts.get(key)
        if text is not None:
            self._texts.move_to_end(key)
            return text
        text = self.policy.decode(response_ids)
        self._texts[key] = text
        while len(self._texts) > TEXTS_KEPT:
            self._texts.popitem(last=False)
        return text

    def fork(self) -> "RLTask":
        """This task for another controller: the loaded records, renderers and scorer are
        shared (read only), the response-text cache is its own."""
        twin = copy.copy(self)
        twin._texts = OrderedDict()
        return twin

    def judge_prompt(self, prompt: PromptData, response_ids: Sequence[int]) -> list[int]:
        """The GenRM's prompt; a response too long for models.genrm.max_prompt_len keeps its
        tail (where the answer is). Always fits: `load` left out the rows whose judge prompt
        does not fit with an empty response."""
        rec = self.records[prompt.pid]
        response = self.text(response_ids)
        ids = self._judge_ids(rec, response)
        if len(ids) <= self.max_judge:
            return ids
        cut = self.genrm.encode(response)
        keep = len(cut)
        while len(ids) > self.max_judge and keep > 0:
            # a cut text can re-encode longer (a split character decodes to U+FFFD, 3 bytes)
            keep -= max(1, len(ids) - self.max_judge)
            ids = self._judge_ids(rec, self.genrm.decode(cut[-keep:]) if keep > 0 else "")
        return ids

    def _judge_ids(self, rec: D.Record, response: str) -> list[int]:
        return self.genrm.ids([{"role": "user", "content": fill(
            self.template, rec.problem, response, rec.answer)}])

    def verdict(self, prompt: PromptData, response_ids: Sequence[int]):
        """The verifiable reward of a response. The user's function raising: a
        RewardFunctionError naming it, the prompt and its data source, or with
        `reward.on_error: default` the default score (logged, counted in `reward_errors`)."""
        rec = self.records[prompt.pid]
        try:
            return self.scorer(rec.data_source, self.text(response_ids), rec.answer,
                               rec.extra_info)
        except Exception as e:   # the user's function may raise anything
            r = self.cfg.reward
            what = (f"the reward function {r.verifiable} raised {type(e).__name__}: {e} on "
                    f"prompt {prompt.pid} (data_source {rec.data_source!r})")
            if r.on_error != "default":
                raise RewardFunctionError(f"{what}; reward.on_error=default scores such a "
                                          f"response reward.verifiable_default") from e
            self.reward_errors += 1
            log.warning("%s: scored %s (reward.on_error=default)", what, r.verifiable_default)
            return Verdict(r.verifiable_default, False)

    def correct(self, prompt: PromptData, response_ids: Sequence[int]) -> bool:
        return self.verdict(prompt, response_ids).correct

    def score(self, prompt: PromptData, response_ids: Sequence[int],
              judge_ids: Sequence[int]) -> Score:
        j = parse_judgement(self.genrm.decode(judge_ids), self.rule, self.opens_thinking)
        w = self.cfg.reward.weights
        score = Score(self.verdict(prompt, response_ids).score, j.score, j.parsed,
                      w.verifiable, w.genrm)
        self._texts.pop(tuple(response_ids), None)   # its last use
        return score


    def describe(self, prompt: PromptData, response_ids: Sequence[int],
                 judge_ids: Sequence[int]) -> dict[str, str]:
        """A sample's texts for a person (the trace's `samples` rows): the prompt as the
        policy saw it, the response, the judgement and how it was read (parsed, unparsed,
        truncated: the thinking never closed; "" when there is no judgement)."""
        judgement = self.genrm.decode(judge_ids) if judge_ids else ""
        outcome = ""
        if judge_ids:
            j = parse_judgement(judgement, self.rule, self.opens_thinking)
            outcome = "parsed" if j.parsed else "truncated" if j.truncated else "unparsed"
        return {"prompt": self.policy.decode(prompt.prompt_ids),
                "response": self.policy.decode(response_ids), "judgement": judgement,
                "parse": outcome}


# The last task loaded in this process, by its settings: `pivotrl simulate` builds a
# controller for every candidate of its search (21 for a paper group), each with the same
# task. Only what loading reads is shared; each build_task gets its own RLTask (fork).
_LOADED: dict[str, tuple[RLTask, list[PromptData], list[PromptData]]] = {}


def build_task(cfg: Config) -> tuple[RLTask, list[PromptData], list[PromptData]]:
    """The task, the training prompts in step order, and the validation prompts (none
    without data.validation or rl.eval_every); TaskError names the key to fix. Loaded once
    per process for the same task settings; every caller gets its own RLTask and lists."""
    key = repr((cfg.data, cfg.reward, cfg.models.policy, cfg.models.genrm, cfg.rl,
                [_stamp(p) for p in (cfg.data.train, cfg.data.validation,
                                     cfg.reward.genrm_template,
                                     cfg.reward.verifiable.rsplit(":", 1)[0])]))
    if key not in _LOADED:
        _LOADED.clear()   # one at a time: a task holds every rendered prompt
        _LOADED[key] = _build(cfg)
    task, train, validation = _LOADED[key]
    return task.fork(), list(train), list(validation)


def _stamp(path: str) -> tuple[int, int] | None:
    """A file's (mtime, size): a file rewritten in place is built again."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_mtime_ns, st.st_size


def _build(cfg: Config) -> tuple[RLTask, list[PromptData], list[PromptData]]:
    task = RLTask(cfg)
    train = task.load("train")
    task.dry_check(train[0])
    validation: list[PromptData] = []
    used = cfg.rl.eval_every > 0 or cfg.rl.eval_before_train
    if cfg.data.validation and cfg.data.format != "synthetic":
        validation = task.load("validation", cfg.rl.eval_prompts)   # checked when set
        if not used:
            log.warning("data.validation %s is set but never evaluated (rl.eval_every is 0 "
                        "and rl.eval_before_train false); set rl.eval_every: N to evaluate "
                        "every N steps and after the last", cfg.data.validation)
    elif cfg.data.format == "synthetic" and used:
        validation = task.load("validation", cfg.rl.eval_prompts)
    return task, task.training_order(train), validation if used else []
