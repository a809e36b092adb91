"""vLLM adapter serving the policy (rollout) and the GenRM (reward); see `engine.VLLMEngine`.

Importing this package does not import vLLM or torch; they load when an engine starts.
"""
from pivotrl_hpc.engines.vllm.engine import VLLMEngine
from pivotrl_hpc.engines.vllm.types import (AbortedSequence, EngineOptions, EngineState,
                                            FinishedSequence, RunningSequence, Sampling,
                                            SeqProgress, StepOutput)

__all__ = ["AbortedSequence", "EngineOptions", "EngineState", "FinishedSequence",
           "RunningSequence", "Sampling", "SeqProgress", "StepOutput", "VLLMEngine"]
