"""A short supervised warm start of the tiny models (`pivotrl init-models`), so that the CPU
demo trains on the paper's reward (R_DAPO + R_GenRM) and not on noise.

A random-weight policy never writes DAPO's `Answer: N` line, so every response scores -1, a
GRPO group has no variance and the loss is exactly 0; a random GenRM never writes a verdict.
So, on the training problems rendered as the run renders them (each folder's own chat
template; the judge prompt from the tiny family's template):
- the policy learns the answers of the (small) training set, but writes the `Answer: N` line
  only about half of the time (`ANSWERED`) and a line without one otherwise: a group's
  rewards differ, and what GRPO can learn within a few steps is the choice every prompt
  shares, to answer (a 64-problem set was memorised too poorly in a CPU minute: sampled
  answers right 1 time in 10, and then the GenRM's noise was the only signal, issue 48);
- the GenRM learns to answer the tiny template's "Verdict (yes or no)?" with `yes` when DAPO
  scores the response correct and `no` otherwise, on the shapes the policy writes in the CPU
  configs' budget mode (right, wrong, unanswered, blank, cut short by the drawn length). A
  GenRM that said yes to blank and cut responses had GRPO learn to answer blank.
Deterministic (seeded data, order and initialisation; one thread), under a minute quiet.
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc.task.synthetic import make_split

log = logging.getLogger(__name__)

ANSWERED = (1, 1)       # targets of each problem with the Answer line, and without
NO_ANSWER = "Let us compute the result step by step."


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int
    lr: float
    warmup: int = 0         # > 0: linear warm-up over these steps, then a cosine decay
    clip: float = 0.0       # > 0: the gradient's norm clipped to this
    verdict: bool = False   # the first target token's loss counted apart (see `_loss`)


POLICY = Schedule(steps=200, batch=32, lr=3e-3)
# Many small steps: a 60 x 16 fit said "no" to every response alike (it had not yet learned to
# look at the response); 200 x 8 tells an answer from blank and unanswered ones. At lr 2e-3,
# unclipped, on 40 % yes and the verdict 1 target in 6, the outcome was the CPU kernels' to
# decide (one AVX-512 machine: no to every response); balanced verdicts, the verdict's loss
# apart, lr 1e-3 and clipping learn it the same under each kernel set tried.
GENRM = Schedule(steps=200, batch=8, lr=1e-3, warmup=10, clip=1.0, verdict=True)
GENRM_PER_PROBLEM = 64  # judged responses for each training problem: half yes, half no


def wrong(answer: str, rng: random.Random) -> str:
    """A plausible wrong number: the answer off by a few, or another problem's size."""
    n = int(answer) + rng.choice((-10, -2, -1, 1, 2, 10))
    return str(n) if rng.random() < 0.7 else str(rng.randint(-99, 999))


def judged_response(answer: str, rng: random.Random, tok) -> tuple[str, bool]:
    """A response as the warm policy writes it in budget mode, and whether DAPO scores it
    correct: right (40 %), wrong (25 %), the line without an answer cut anywhere (10 %), blank
    (10 %: EOS first, only the blank lines past it), the answer cut a token or more short by
    the drawn length (15 %); then 0-3 blank lines written past EOS."""
    from pivotrl_hpc.task.rewards import dapo_score

    kind, cut = rng.random(), lambda text, n: tok.decode(
        tok(text, add_special_tokens=False)["input_ids"][:n])
    if kind < 0.4:
        text = f"Answer: {answer}"
    elif kind < 0.65:
        text = f"Answer: {wrong(answer, rng)}"
    elif kind < 0.75:
        text = cut(NO_ANSWER, rng.randint(1, 9))
    elif kind < 0.85:
        text = ""
    else:
        full = f"Answer: {answer}"
        text = cut(full, rng.randrange(1, len(tok(full, add_special_tokens=False)["input_ids"])))
    text += "\n" * rng.choice((0, 0, 1, 2, 3))
    return text, bool(dapo_score("", text, answer)["acc"])


AFTER_EOS = 2   # blank lines after the EOS, each followed by EOS again


def _encode(tok, messages: list[dict], target: str) -> tuple[list[int], list[int]]:
    """Prompt ids and target ids: the target text, EOS, then blank lines and EOS again. The
    CPU configs' budget mode ignores EOS (lengths drawn as the paper's long tail); what a
    model writes past it then only adds blank lines, and the answer's line stays whole."""
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    eos, newline = tok.eos_token_id, tok("\n", add_special_tokens=False)["input_ids"]
    out = tok(target, add_special_tokens=False)["input_ids"] + [eos]
    return ids, out + (newline + [eos]) * AFTER_EOS


def policy_examples(folder: Path, problems: list[dict]) -> list:
    """Each problem answered `ANSWERED[0]` times and left unanswered `ANSWERED[1]` times:
    the policy learns to write the Answer line for every problem some of the time."""
    from transformers import AutoTokenizer

    from pivotrl_hpc.task.synthetic import dapo_row

    tok = AutoTokenizer.from_pretrained(str(folder))
    out = []
    for p in problems:
        messages = dapo_row(p, "")["prompt"]
        out += [_encode(tok, messages, f"Answer: {p['answer']}")] * ANSWERED[0]
        out += [_encode(tok, messages, NO_ANSWER)] * ANSWERED[1]
    return out


def genrm_examples(folder: Path, problems: list[dict], seed: int) -> list:
    from transformers import AutoTokenizer

    from pivotrl_hpc.task.synthetic import dapo_row
    from pivotrl_hpc.task.judge import fill, template_text

    tok, rng = AutoTokenizer.from_pretrained(str(folder)), random.Random(seed)
    template, out = template_text("tiny"), []
    for p in problems:
        problem = dapo_row(p, "")["prompt"][0]["content"]
        for response, right in _balanced(p["answer"], rng, tok):
            text = fill(template, problem, response, p["answer"])
            # one word, as the template's "Verdict (yes or no)?" asks: fits any length budget
            out.append(_encode(tok, [{"role": "user", "content": text}], "yes" if right else "no"))
    return out


def _balanced(answer: str, rng: random.Random, tok) -> list[tuple[str, bool]]:
    """`GENRM_PER_PROBLEM` responses drawn by `judged_response`, half of them correct: with
    40 % yes, "no" to everything was a minimum some fits fell into."""
    half, got = GENRM_PER_PROBLEM // 2, {True: [], False: []}
    while min(len(v) for v in got.values()) < half:
        response, right = judged_response(answer, rng, tok)
        if len(got[right]) < half:
            got[right].append((response, right))
    return got[True] + got[False]


def train(folder: Path, examples: list, schedule: Schedule, seed: int) -> float:
    """Fine-tune the model in `folder` on (prompt ids, target ids) pairs, loss on the
    targets only; save it back. Returns the last batch's loss."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread: the same sums, so the same weights, everywhere
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=0.0)
        lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(schedule, s))
        rng, loss = random.Random(seed), torch.tensor(float("nan"))
        model.train()
        for _ in range(schedule.steps):
            ids, labels, mask = _batch(rng.sample(examples, min(schedule.batch, len(examples))))
            loss = _loss(model, ids, labels, mask, schedule.verdict)
            opt.zero_grad()
            loss.backward()
            if schedule.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.clip)
            opt.step()
            lr.step()
        model.eval()
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    log.info("warm start of %s: %d steps, last loss %.3f", folder, schedule.steps, loss.item())
    return float(loss.item())


def _loss(model, ids, labels, mask, verdict: bool):
    """The targets' mean cross-entropy; `verdict`: the first target token's mean plus the
    others' mean, so the verdict weighs as much as the EOS and blank lines after it."""
    import torch

    if not verdict:
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    logits, target = model(input_ids=ids, attention_mask=mask).logits[:, :-1], labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                           reduction="none")
    valid = (target != -100).float()
    first = valid * (valid.cumsum(1) == 1).float()
    return (ce * first).sum() / first.sum() + (ce * (valid - first)).sum() / (valid - first).sum()


def _lr_factor(schedule: Schedule, step: int) -> float:
    """1 throughout, or a linear warm-up then a cosine decay to 5 % (`schedule.warmup`)."""
    if not schedule.warmup:
        return 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * step / schedule.steps))
    return min(1.0, (step + 1) / schedule.warmup) * (0.05 + 0.95 * cosine)


def _batch(pairs: list):
    """Right-padded ids, labels (-100 on prompt and padding) and the attention mask."""
    import torch

    n = max(len(p) + len(t) for p, t in pairs)
    ids = torch.zeros((len(pairs), n), dtype=torch.long)
    labels = torch.full((len(pairs), n), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), n), dtype=torch.long)
    for i, (p, t) in enumerate(pairs):
        seq = p + t
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(p):len(seq)] = torch.tensor(t)
        mask[i, :len(seq)] = 1
    return ids, labels, mask


def warm_start(out: Path, seed: int, train_problems: int,
               genrm: bool = True) -> dict[str, float]:
    """Warm-start `out`/policy (and `out`/genrm) on the training split of `seed`: the
    problems `write_dataset(out/data, seed, train_problems)` wrote. Returns last losses."""
    problems = make_split(seed, train_problems)
    losses = {"policy": train(out / "policy", policy_examples(out / "policy", problems),
                              POLICY, seed)}
    if genrm:
        losses["genrm"] = train(out / "genrm", genrm_examples(out / "genrm", problems,
                                                              seed + 1), GENRM, seed + 1)
    return losses
