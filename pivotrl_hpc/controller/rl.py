"""RL bookkeeping of the controller (paper §2, §8.1): prompts -> GRPO groups -> samples ->
judge sequences -> rewards -> training batches, with staleness as admission control.

Staleness k (paper footnote 4): the version lag between the policy that generated a sample
and the policy trained on it. Prompt i lands in batch `i // batch_size` (the batch of step
b trains policy version b into b + 1), and its rollout starts only when that batch is at
most k versions ahead of the oldest policy any rollout replica serves. So every trained
sample has lag <= k and no generated sample is ever discarded; the burst admitted after each
step is what drives the shifts. With `partial` (beyond the paper, sched/partial.py) the
same count is admitted, but a group's step is chosen when it is formed, from the complete
groups, by each group's deadline (its admission version + k). Pure: no I/O, no clocks
(times are passed in).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from pivotrl_hpc.protocol.engine import Sampling
from pivotrl_hpc.sched.partial import Group, deadline, form_batch
from pivotrl_hpc.task.types import PromptData, Score  # the loop's vocabulary
from pivotrl_hpc.task.errors import RewardFunctionError


class Task(Protocol):
    """What the RL loop needs from the task: judge prompts and scores (token ids in and out)."""

    def judge_prompt(self, prompt: PromptData, response_ids: Sequence[int]) -> list[int]: ...

    def score(self, prompt: PromptData, response_ids: Sequence[int],
              judge_ids: Sequence[int]) -> Score: ...

    def correct(self, prompt: PromptData, response_ids: Sequence[int]) -> bool: ...


@dataclass
class Sample:
    """One response of a GRPO group, from admission to training."""
    sid: int
    prompt: PromptData
    # the step it trains in (partial rollout: the last it may, until its step is formed);
    # validation after step s: -1 - s
    batch: int
    budget: int                      # max new tokens
    sampling: Sampling
    judge_budget: int = 0
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None       # oldest policy version that generated its tokens
    judge_prompt: list[int] = field(default_factory=list)
    judgement: list[int] = field(default_factory=list)
    score: Score | None = None
    state: str = "admitted"          # admitted, rolled, rewarded, trained
    group: int = -1                  # its prompt's admission index (validation: -1)

    @property
    def tokens(self) -> int:
        """Prompt + response tokens: what end-to-end throughput counts (docs/trace.md)."""
        return len(self.prompt.prompt_ids) + len(self.response)


@dataclass(frozen=True)
class Lengths:
    """Per-sample length budgets: log-normal (median, sigma) capped, or the cap (eos mode)."""
    mode: str
    rollout_median: int
    rollout_sigma: float
    rollout_cap: int
    genrm_median: int
    genrm_sigma: float
    genrm_cap: int

    def draw(self, rng: random.Random, median: int, sigma: float, cap: int) -> int:
        if self.mode == "eos":
            return cap
        return max(1, min(cap, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


class RLBook:
    def __init__(self, prompts: Sequence[PromptData], *, steps: int, batch_size: int,
                 group_size: int, staleness: int, lengths: Lengths, temperature: float,
                 seed: int = 0, keep_trained: bool = True, eval_samples: int = 1,
                 eval_temperature: float = 0.0, partial: bool = False) -> None:
        self.prompts, self.steps = list(prompts), steps
        self.batch_size, self.group_size, self.staleness = batch_size, group_size, staleness
        self.lengths, self.temperature = lengths, temperature
        self.rng = random.Random(seed)
        self.eval_samples, self.eval_temperature = eval_samples, eval_temperature
        self.partial = partial             # partial rollout (sched/partial.py)
        self.samples: dict[int, Sample] = {}
        # False (a job): a trained sample is dropped, else the book grows by a batch a step
        # (20 MB over 200 tiny steps, `pivotrl bench soak`); tests keep them to inspect
        self.keep_trained = keep_trained
        self.next_prompt = 0               # prompts admitted so far
        self.next_sid = 0
        self.held_s = 0.0                  # seconds admission was held by the staleness bound
        self._held_since: float | None = None
        self._open: float | None = None    # _oldest_open's cache (None: to compute)
        self.unparsed = 0

    # --- admission ---------------------------------------------------------------------
    def batch_of(self, i: int) -> int:
        return i // self.batch_size

    def admit(self, gen_version: int, now: float, per_batch: bool = False) -> list[Sample]:
        """Admit every prompt whose batch is at most `staleness` ahead of `gen_version`; `per_batch`
        (rr_colocated, Appendix E): a batch only once every sample before it is judged.
        `held_s` counts the staleness bound's holds only."""
        out: list[Sample] = []
        total = self.steps * self.batch_size
        while self.next_prompt < total and not self._stale(gen_version):
            batch = self.batch_of(self.next_prompt)
            if per_batch and self._oldest_open() < batch:
                break
            prompt = self.prompts[self.next_prompt % len(self.prompts)]
            # partial rollout: trained by its deadline, in a step chosen when formed
            out += self._group(prompt, deadline(gen_version, self.staleness)
                               if self.partial else batch)
            self.next_prompt += 1
        blocked = self.next_prompt < total and self._stale(gen_version)
        if blocked and self._held_since is None:
            self._held_since = now
        elif not blocked or out:
            self._release(now)
        return out

    def _stale(self, gen_version: int) -> bool:
        return self.batch_of(self.next_prompt) - gen_version > self.staleness

    def _oldest_open(self) -> float:
        """The oldest batch with a sample not judged yet (inf: none). Cached until a sample
        is admitted or judged: admission asks every loop turn."""
        if self._open is None:
            # partial rollout: a sample's batch is its deadline; the cycle is by admission
            self._open = min((self.batch_of(s.group) if self.partial else s.batch
                              for s in self.samples.values()
                              if s.batch >= 0 and s.state in ("admitted", "rolled")),
                             default=math.inf)
        return self._open

    def _release(self, now: float) -> None:
        if self._held_since is not None:
            self.held_s += now - self._held_since
            self._held_since = None

    def _group(self, prompt: PromptData, batch: int) -> list[Sample]:
        L = self.lengths
        group = []
        for _ in range(self.group_size):
            budget = L.draw(self.rng, L.rollout_median, L.rollout_sigma, L.rollout_cap)
            sampling = Sampling(temperature=self.temperature, seed=self.rng.randrange(2**31),
                                ignore_eos=L.mode == "budget")
            group.append(self._new(prompt, batch, budget, sampling))
            group[-1].group = self.next_prompt
        return group

    def validation(self, prompts: Sequence[PromptData]) -> list[Sample]:
        """`eval_samples` samples of each prompt for validation accuracy (pass@1 = the mean
        of their correctness; never rewarded or trained): greedy at temperature 0."""
        def sampling() -> Sampling:
            if self.eval_temperature <= 0:
                return Sampling(temperature=0.0)
            return Sampling(temperature=self.eval_temperature, seed=self.rng.randrange(2**31))
        return [self._new(p, -1, self.lengths.rollout_cap, sampling())
                for p in prompts for _ in range(self.eval_samples)]

    def _new(self, prompt: PromptData, batch: int, budget: int, sampling: Sampling) -> Sample:
        s = Sample(self.next_sid, prompt, batch, budget, sampling)
        self._open = None
        s.judge_budget = self.lengths.draw(self.rng, self.lengths.genrm_median,
                                           self.lengths.genrm_sigma, self.lengths.genrm_cap)
        self.samples[s.sid] = s
        self.next_sid += 1
        return s

    # --- rollout -> reward -> batch ----------------------------------------------------
    def rolled(self, sid: int, response: Sequence[int], logprobs: Sequence[float],
               version: int | None, task: Task) -> Sample:
        s = self.samples[sid]
        if s.state != "admitted":
            raise RuntimeError(f"sample {sid} finished rollout twice (state {s.state})")
        s.response, s.logprobs = list(response), list(logprobs)
        s.version, s.state = version, "rolled"
        if s.batch >= 0:
            s.judge_prompt = task.judge_prompt(s.prompt, s.response)
        return s

    def rewarded(self, sid: int, judgement: Sequence[int], task: Task) -> Sample:
        s = self.samples[sid]
        if s.state != "rolled":
            raise RuntimeError(f"sample {sid} rewarded in state {s.state}")
        s.judgement = list(judgement)
        try:
            s.score = task.score(s.prompt, s.response, s.judgement)
        except RewardFunctionError as e:
            raise RewardFunctionError(f"sample {sid}: {e}") from e.__cause__
        self.unparsed += not s.score.parsed
        s.state = "rewarded"
        self._open = None
        return s

    def batch_ready(self, step: int) -> bool:
        if (step >= self.steps or self.batch_of(self.next_prompt - 1) < step
                or self.next_prompt == 0):
            return False
        if self.partial:
            return self._formable(step) is not None
        members = self.batch_samples(step)
        return len(members) == self.batch_size * self.group_size and all(
            s.state == "rewarded" for s in members)

    def batch_samples(self, step: int) -> list[Sample]:
        return sorted((s for s in self.samples.values() if s.batch == step), key=lambda s: s.sid)

    def form(self, step: int) -> list[Sample]:
        """The samples step `step` trains, once `batch_ready(step)`: the paper's batch, or
        (partial rollout) the groups chosen now, which from here on belong to `step`."""
        if self.partial:
            chosen = set(self._formable(step) or ())
            if not chosen:
                raise RuntimeError(f"step {step} formed before its batch was ready")
            for s in self.samples.values():
                if s.group in chosen and s.batch >= 0:
                    s.batch = step
        return self.batch_samples(step)

    def group_ids(self, samples: Sequence[Sample]) -> tuple[int, ...]:
        """The trainer's GRPO groups: the prompt's id (the paper's batch holds consecutive
        prompts); partial rollout's may hold a prompt twice when the dataset is shorter than
        k + 1 batches, so each admitted group is its own."""
        return tuple(s.group if self.partial else s.prompt.pid for s in samples)

    def _formable(self, step: int) -> list[int] | None:
        """Partial rollout: the groups step `step` would train now (sched/partial.py)."""
        groups: dict[int, list[Sample]] = {}
        for s in self.samples.values():
            if s.batch >= 0 and s.state != "trained":
                groups.setdefault(s.group, []).append(s)
        return form_batch([Group(g, min(s.batch for s in m), len(m) == self.group_size and all(
            s.state == "rewarded" for s in m)) for g, m in groups.items()], step,
            self.batch_size)

    def trained(self, step: int) -> list[Sample]:
        members = self.batch_samples(step)
        for s in members:
            s.state = "trained"
            if not self.keep_trained:
                del self.samples[s.sid]
        return members

    def in_flight(self) -> int:
        return sum(s.state in ("admitted", "rolled") for s in self.samples.values()
                   if s.batch >= 0)


def lag(sample: Sample) -> int:
    """Version lag of a trained sample: its step minus its oldest generating version."""
    return sample.batch - (sample.version if sample.version is not None else 0)
