"""The training batch the rollout/reward stages hand to the Megatron trainer.

Layout: one row per sequence (prompt + response), right-padded. Per-token tensors are aligned
with `tokens`: entry [b, t] is about token t given tokens[b, :t], so position 0 never carries a
logprob and prompt positions are masked out of the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class RolloutBatch:
    tokens: torch.Tensor              # [B, S] int64, right-padded with pad_id
    response_mask: torch.Tensor       # [B, S] bool, True where a response token is trained on
    behaviour_logprobs: torch.Tensor  # [B, S] float32, log pi_behaviour(token); 0 off-mask
    rewards: torch.Tensor             # [B] float32, one scalar per sequence
    group_ids: torch.Tensor           # [B] int64, sequences of the same prompt share an id
    reference_logprobs: Optional[torch.Tensor] = None  # [B, S], only for a KL penalty

    def __post_init__(self) -> None:
        b, s = self.tokens.shape
        for name in ("response_mask", "behaviour_logprobs"):
            if tuple(getattr(self, name).shape) != (b, s):
                raise ValueError(f"{name} must have shape {(b, s)}")
        if self.reference_logprobs is not None and tuple(self.reference_logprobs.shape) != (b, s):
            raise ValueError(f"reference_logprobs must have shape {(b, s)}")
        if self.rewards.shape != (b,) or self.group_ids.shape != (b,):
            raise ValueError("rewards and group_ids need one entry per sequence")
        if bool(self.response_mask[:, 0].any()):
            raise ValueError("position 0 has no logprob and cannot be a response token")

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       response_logprobs: Sequence[Sequence[float]], rewards: Sequence[float],
                       group_ids: Sequence[int], pad_id: int = 0,
                       pad_to_multiple: int = 1) -> "RolloutBatch":
        """Pack rollout output (prompt ids, response ids and their sampling logprobs)."""
        n = len(prompts)
        if not (len(responses) == len(response_logprobs) == len(rewards) == len(group_ids) == n):
            raise ValueError("prompts, responses, logprobs, rewards, group_ids differ in length")
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        s = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
        tokens = torch.full((n, s), pad_id, dtype=torch.long)
        mask = torch.zeros((n, s), dtype=torch.bool)
        old = torch.zeros((n, s), dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logprobs)):
            if not p:
                raise ValueError(f"sequence {i} has an empty prompt")
            if len(lp) != len(r):
                raise ValueError(f"sequence {i}: {len(r)} response tokens, {len(lp)} logprobs")
            tokens[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
            mask[i, len(p):len(p) + len(r)] = True
            old[i, len(p):len(p) + len(r)] = torch.tensor(list(lp), dtype=torch.float32)
        return cls(tokens=tokens, response_mask=mask, behaviour_logprobs=old,
                   rewards=torch.tensor(list(rewards), dtype=torch.float32),
                   group_ids=torch.tensor(list(group_ids), dtype=torch.long))

    def select(self, rows: torch.Tensor | slice) -> "RolloutBatch":
        """The sub-batch of the given rows (a DP rank's share, a micro-batch)."""
        ref = None if self.reference_logprobs is None else self.reference_logprobs[rows]
        return RolloutBatch(tokens=self.tokens[rows], response_mask=self.response_mask[rows],
                            behaviour_logprobs=self.behaviour_logprobs[rows],
                            rewards=self.rewards[rows], group_ids=self.group_ids[rows],
                            reference_logprobs=ref)


def random_batch(vocab_size: int, n: int, seq: int, seed: int = 0) -> RolloutBatch:
    """`n` random sequences of `seq` tokens (a quarter prompt), groups of 4 with rewards
    1, 0, 0.5, 0: a GRPO batch with non-zero advantages for benchmarks and checks."""
    g = torch.Generator().manual_seed(seed)
    prompt, response = seq // 4, seq - seq // 4
    prompts = [torch.randint(3, vocab_size, (prompt,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, vocab_size, (response,), generator=g).tolist()
                 for _ in range(n)]
    return RolloutBatch.from_sequences(prompts, responses, [[-1.0] * response] * n,
                                       [(1.0, 0.0, 0.5, 0.0)[i % 4] for i in range(n)],
                                       [i // 4 for i in range(n)])
