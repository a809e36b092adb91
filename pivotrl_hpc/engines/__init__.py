"""Engine adapters: `vllm` (rollout and GenRM replicas) and `megatron` (training)."""
