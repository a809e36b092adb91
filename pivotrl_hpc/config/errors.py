"""Configuration errors: each names the key, the bad value and what is allowed."""
from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")
