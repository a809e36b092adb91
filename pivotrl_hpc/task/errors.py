"""The task layer's errors: TaskError names the config key to fix (launch/preflight.py turns
it into a ConfigError before any device starts); RewardFunctionError is the user's reward
function failing on a response while the job runs."""
from __future__ import annotations


class TaskError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class RewardFunctionError(RuntimeError):
    """The verifiable reward function raised: names it, the sample and its data source."""
