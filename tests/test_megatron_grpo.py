"""GRPO / DAPO math of the Megatron trainer, checked on hand-computed examples (no Megatron)."""
from __future__ import annotations

import math

import pytest
import torch

from pivotrl_hpc.engines.megatron.batch import RolloutBatch
from pivotrl_hpc.engines.megatron.grpo import GRPOConfig, group_advantages, policy_loss


def test_group_advantages_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5, 9])
    adv = group_advantages(rewards, groups, eps=1e-6)
    # Group 0: mean 0.375, deviations (.625, -.375, .125, -.375), squares sum to 0.6875,
    # unbiased var 0.6875 / 3, std 0.4787136. Group 5: mean 0.5625, std 0.5153882.
    # Group 9 has one member: no spread, advantage 0.
    expected = [0.625 / (0.4787136 + 1e-6), -0.375 / (0.4787136 + 1e-6),
                0.125 / (0.4787136 + 1e-6), -0.375 / (0.4787136 + 1e-6),
                0.4375 / (0.5153882 + 1e-6), 0.4375 / (0.5153882 + 1e-6),
                -0.5625 / (0.5153882 + 1e-6), -0.3125 / (0.5153882 + 1e-6), 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    assert adv[0].item() == pytest.approx(1.3055797, abs=1e-5)


def test_group_advantages_without_std_and_with_equal_rewards():
    adv = group_advantages(torch.tensor([2.0, 4.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                           normalize_std=False)
    assert adv.tolist() == [-1.0, 1.0, 0.0, 0.0]
    # All-equal rewards: std 0, so the eps keeps the advantage finite (and zero).
    same = group_advantages(torch.tensor([0.7, 0.7, 0.7]), torch.tensor([3, 3, 3]))
    assert same.tolist() == [0.0, 0.0, 0.0]


def _one_token_rows(log_ratios):
    """Rows of two tokens whose second token is the only response token."""
    n = len(log_ratios)
    mask = torch.zeros(n, 2, dtype=torch.bool)
    mask[:, 1] = True
    old = torch.zeros(n, 2)
    old[:, 1] = -2.0
    new = old.clone()
    new[:, 1] += torch.tensor(log_ratios)
    return new.requires_grad_(True), old, mask


def test_clip_zeroes_gradient_beyond_the_clip_range():
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28)
    # rows: (A=+1, r=e^.5)  clipped above      -> loss -1.28, grad 0
    #       (A=+1, r=1.1)   inside             -> loss -1.1,  dloss/dlogp = -1.1 / 4
    #       (A=-1, r=0.5)   clipped below      -> loss +0.8,  grad 0
    #       (A=-1, r=e^.5)  negative A, high r -> loss +e^.5, dloss/dlogp = +e^.5 / 4
    new, old, mask = _one_token_rows([0.5, math.log(1.1), math.log(0.5), 0.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = policy_loss(new, old, adv, mask, cfg, normaliser=4.0)
    out.loss.backward()
    e5 = math.exp(0.5)
    assert out.loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + e5) / 4, abs=1e-6)
    grads = new.grad[:, 1].tolist()
    assert grads == pytest.approx([0.0, -1.1 / 4, 0.0, e5 / 4], abs=1e-6)
    assert new.grad[:, 0].abs().max().item() == 0.0  # prompt positions never get gradient
    assert out.clipped_tokens == 2.0 and out.tokens == 4.0
    assert out.ratio_sum == pytest.approx(e5 + 1.1 + 0.5 + e5, abs=1e-5)


def test_clip_higher_is_separate_from_clip_low():
    new, old, mask = _one_token_rows([math.log(1.25)])
    adv = torch.tensor([1.0])
    policy_loss(new, old, adv, mask, GRPOConfig(clip_low=0.2, clip_high=0.28), 1.0).loss.backward()
    assert new.grad[0, 1].item() == pytest.approx(-1.25, abs=1e-6)  # inside 1 + 0.28
    new2, _, _ = _one_token_rows([math.log(1.25)])
    sym = policy_loss(new2, old, adv, mask, GRPOConfig(clip_low=0.2, clip_high=0.2), 1.0)
    sym.loss.backward()
    assert new2.grad[0, 1].item() == 0.0 and sym.clipped_tokens == 1.0  # beyond 1 + 0.2


def test_loss_is_a_token_level_mean_over_the_batch():
    # Sequence 0: one response token, A = +1. Sequence 1: three response tokens, A = -1.
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    lp = torch.full((2, 4), -1.0)
    out = policy_loss(lp, lp.clone(), torch.tensor([1.0, -1.0]), mask, GRPOConfig(),
                      normaliser=float(mask.sum()))
    # ratio 1 everywhere: per-token loss -A; token mean (-1 + 3) / 4 = 0.5, whereas a
    # per-sequence mean would give (-1 + 1) / 2 = 0.
    assert out.loss.item() == pytest.approx(0.5)
    assert out.clipped_tokens == 0.0


def test_kl_penalty_off_by_default_and_k3_when_on():
    new, old, mask = _one_token_rows([0.0])
    ref = old.clone()
    ref[:, 1] = -2.5  # reference logprob 0.5 below the policy's
    base = policy_loss(new, old, torch.tensor([0.0]), mask, GRPOConfig(), 1.0)
    assert base.loss.item() == 0.0 and base.kl_sum == 0.0
    on = policy_loss(new, old, torch.tensor([0.0]), mask, GRPOConfig(kl_coef=0.1), 1.0,
                     reference_logprobs=ref)
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert on.kl_sum == pytest.approx(k3, abs=1e-6)
    assert on.loss.item() == pytest.approx(0.1 * k3, abs=1e-6)
    with pytest.raises(ValueError):
        policy_loss(new, old, torch.tensor([0.0]), mask, GRPOConfig(kl_coef=0.1), 1.0)


def test_rollout_batch_packing():
    b = RolloutBatch.from_sequences(prompts=[[5, 6], [7]], responses=[[8, 9, 10], [11]],
                                    response_logprobs=[[-0.1, -0.2, -0.3], [-0.4]],
                                    rewards=[1.0, 0.0], group_ids=[0, 0], pad_id=0,
                                    pad_to_multiple=4)
    assert b.tokens.tolist() == [[5, 6, 8, 9, 10, 0, 0, 0], [7, 11, 0, 0, 0, 0, 0, 0]]
    assert b.response_mask.int().tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert b.behaviour_logprobs[0, 2:5].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.behaviour_logprobs[1, 1].item() == pytest.approx(-0.4)
    assert b.num_response_tokens == 4
    assert b.select(slice(1, 2)).tokens.tolist() == [[7, 11, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError):
        RolloutBatch.from_sequences([[1]], [[2, 3]], [[-0.1]], [0.0], [0])
