"""A short supervised warm start of the tiny models (`pivotrl init-models`), so that the CPU
demo trains on the paper's reward (R_DAPO + R_GenRM) and not on noise.

A random-weight policy never writes DAPO's `Answer: N` line, so every response scores -1, a
GRPO group has no variance and the loss is exactly 0; a random GenRM never writes a verdict.
So, on the training problems rendered as the run renders them (each folder's own chat
template; the judge prompt from the tiny family's template):
- the policy learns to answer `Answer: N` some of the time (`ANSWERED`), else a line without
  one, and is stopped short (`POLICY_STEPS`), so its sampled answers are right only some of
  the time: a group's rewards differ, which is what GRPO learns from;
- the GenRM learns to answer the tiny template's "Verdict (yes or no)?" with `yes` when the
  response's answer is the reference's and `no` otherwise, on responses of the three kinds
  the policy writes.
Deterministic (seeded data, order and initialisation; one thread), a few seconds on CPU.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc.assets.dataset import make_split

log = logging.getLogger(__name__)

ANSWERED = (4, 1)       # targets of each problem with the Answer line, and without
NO_ANSWER = "Let us compute the result step by step."


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int
    lr: float


POLICY = Schedule(steps=300, batch=64, lr=3e-3)
GENRM = Schedule(steps=60, batch=16, lr=1e-3)


def wrong(answer: str, rng: random.Random) -> str:
    """A plausible wrong number: the answer off by a few, or another problem's size."""
    n = int(answer) + rng.choice((-10, -2, -1, 1, 2, 10))
    return str(n) if rng.random() < 0.7 else str(rng.randint(-99, 999))


def judged_response(answer: str, rng: random.Random) -> tuple[str, bool]:
    """A response as the warm policy writes it, and whether DAPO would score it correct."""
    kind = rng.random()
    if kind < 0.4:
        return f"Answer: {answer}", True
    if kind < 0.8:
        return f"Answer: {wrong(answer, rng)}", False
    return NO_ANSWER, False


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

    from pivotrl_hpc.assets.dataset import dapo_row

    tok = AutoTokenizer.from_pretrained(str(folder))
    out = []
    for p in problems:
        messages = dapo_row(p, "")["prompt"]
        out += [_encode(tok, messages, f"Answer: {p['answer']}")] * ANSWERED[0]
        out += [_encode(tok, messages, NO_ANSWER)] * ANSWERED[1]
    return out


def genrm_examples(folder: Path, problems: list[dict], seed: int) -> list:
    from transformers import AutoTokenizer

    from pivotrl_hpc.assets.dataset import dapo_row
    from pivotrl_hpc.task.judge import fill, template_text

    tok, rng = AutoTokenizer.from_pretrained(str(folder)), random.Random(seed)
    template, out = template_text("tiny"), []
    for p in problems:
        problem = dapo_row(p, "")["prompt"][0]["content"]
        response, right = judged_response(p["answer"], rng)
        text = fill(template, problem, response, p["answer"])
        # one word, as the template's "Verdict (yes or no)?" asks: it fits any length budget
        out.append(_encode(tok, [{"role": "user", "content": text}], "yes" if right else "no"))
    return out


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
        rng, loss = random.Random(seed), torch.tensor(float("nan"))
        model.train()
        for _ in range(schedule.steps):
            ids, labels, mask = _batch(rng.sample(examples, min(schedule.batch, len(examples))))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    log.info("warm start of %s: %d steps, last loss %.3f", folder, schedule.steps, loss.item())
    return float(loss.item())


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
