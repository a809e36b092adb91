"""`pivotrl init-models`' warm start (issue 48): the tiny policy writes DAPO's `Answer: N`
some of the time but not always, and when it answers it is mostly right, so the rewards of a
group differ (a random-weight policy wrote the line 2 times in 2,048: every group's rewards
were equal, GRPO's loss exactly 0); the tiny GenRM answers yes or no, yes to right answers
and no to blank ones. Sampled with transformers (seeded) on the training prompts, as the run
renders them."""
from __future__ import annotations

import collections
import random

import pytest

from pivotrl_hpc.task.synthetic import dapo_row, make_split
from pivotrl_hpc.assets.warmstart import judged_response
from pivotrl_hpc.task.judge import FAMILIES, fill, parse_judgement, template_text
from pivotrl_hpc.task.rewards import dapo_score

PROMPTS, GROUP = 16, 4   # the training set of init-models (its default --train)


def load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    model.generation_config.eos_token_id = None   # budget mode: EOS ignored, as the run's
    return AutoTokenizer.from_pretrained(str(folder)), model


def generate(tok, model, text: str, n: int, new: int, sample: bool) -> list[str]:
    import torch

    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]] * n)
    out = model.generate(ids, do_sample=sample, temperature=1.0 if sample else None,
                         top_k=0 if sample else None, max_new_tokens=new, pad_token_id=0)
    return [tok.decode(o[ids.shape[1]:], skip_special_tokens=True) for o in out]


def chat(tok, content: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)


@pytest.fixture(scope="module")
def sampled(warm_models):
    import torch

    torch.manual_seed(0)
    tok, policy = load(warm_models / "policy")
    rows = [dapo_row(p, "") for p in make_split(0, PROMPTS)]
    return [(row, generate(tok, policy, chat(tok, row["prompt"][0]["content"]), GROUP, 12,
                           True)) for row in rows]


def test_the_policy_answers_in_the_format_some_of_the_time_and_rightly_some(sampled):
    texts = [t for _, group in sampled for t in group]
    answered = sum("Answer:" in t for t in texts) / len(texts)
    scores = [[dapo_score("", t, row["reward_model"]["ground_truth"])["score"] for t in group]
              for row, group in sampled]
    right = sum(s == 1.0 for g in scores for s in g) / len(texts)
    varied = sum(len(set(g)) > 1 for g in scores)
    print(f"answered {answered:.2f}, right {right:.2f}, groups with varied rewards "
          f"{varied}/{len(scores)}")
    # room to learn to answer, and answers worth learning: right when it answers, mostly
    assert 0.3 <= answered <= 0.8 and right >= 0.6 * answered and varied >= len(scores) // 2


def test_the_genrm_writes_a_parseable_verdict_mostly_right(warm_models, sampled):
    tok, genrm = load(warm_models / "genrm")
    rule, template = FAMILIES["tiny"].rule, template_text("tiny")
    parsed = agree = n = 0
    for row, group in sampled[:8]:
        truth = row["reward_model"]["ground_truth"]
        for response in group:
            text = fill(template, row["prompt"][0]["content"], response, truth)
            j = parse_judgement(generate(tok, genrm, chat(tok, text), 1, 4, False)[0], rule)
            right = dapo_score("", response, truth)["acc"]
            parsed += j.parsed
            agree += j.parsed and (j.score == 1.0) == right
            n += 1
    print(f"GenRM verdicts parsed {parsed}/{n}, agreeing with DAPO {agree}/{n}")
    assert parsed == n and agree >= 0.6 * n


def verdicts_on_held_out_shapes(folder, seed: int = 99, per_problem: int = 8) -> dict:
    """The GenRM's greedy first word on responses drawn as its warm start draws them, but
    from another seed (held out), by shape: {shape: (yes, count)}."""
    import torch

    tok, genrm = load(folder)
    yes, no = (tok(w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))
    rng, template = random.Random(seed), template_text("tiny")
    out = collections.defaultdict(lambda: [0, 0])
    for p in make_split(0, PROMPTS) * per_problem:
        response, right = judged_response(p["answer"], rng, tok)
        text = fill(template, dapo_row(p, "")["prompt"][0]["content"], response, p["answer"])
        ids = tok(chat(tok, text), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = genrm(torch.tensor([ids])).logits[0, -1]
        shape = ("blank" if not response.strip() else "right" if right
                 else "unanswered" if "Answer:" not in response else "wrong or cut")
        out[shape][0] += bool(logits[yes] > logits[no])
        out[shape][1] += 1
    return {k: tuple(v) for k, v in out.items()}


def test_the_genrm_says_yes_to_right_answers_and_no_to_blank_ones(warm_models):
    """The GenRM may not reward what GRPO could collapse to: a GenRM that said yes to 17 of 24
    blank responses had disaggregated learn-cpu answer blank from step 8 (loss exactly 0)."""
    got = verdicts_on_held_out_shapes(warm_models / "genrm")
    print("GenRM yes / responses on held-out shapes:", got)
    rate = {k: y / n for k, (y, n) in got.items()}
    assert rate["right"] >= 0.7 and rate["blank"] <= 0.15
    assert rate["unanswered"] <= rate["right"] - 0.2


def test_the_genrm_fit_sees_as_many_yes_as_no(warm_models):
    """Drawn as the run's responses fall (40 % right) the verdicts were mostly "no", and a fit
    that said no to every response was the minimum some CPUs' kernels fell into."""
    from pivotrl_hpc.assets.warmstart import GENRM_PER_PROBLEM, genrm_examples

    tok = load(warm_models / "genrm")[0]
    yes, no = (tok(w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))
    examples = genrm_examples(warm_models / "genrm", make_split(0, PROMPTS), 1)
    verdicts = collections.Counter(target[0] for _, target in examples)
    half = PROMPTS * GENRM_PER_PROBLEM // 2
    assert verdicts == {yes: half, no: half}
