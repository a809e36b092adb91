"""The task layer's one error: names the config key to fix (launch/preflight.py turns it into
a ConfigError before any device starts)."""
from __future__ import annotations


class TaskError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
