"""vLLM adapter serving the policy (rollout) and the GenRM (reward); see `engine.VLLMEngine`.
Its value types (options, sampling, progress, state) are the protocol's (`protocol.engine`).

Importing this package does not import vLLM or torch; they load when an engine starts.
"""
from pivotrl_hpc.engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
