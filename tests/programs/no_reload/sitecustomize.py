"""Fault injection for tests/test_learning.py's control run (a mock, since no input makes a
worker skip its weights): on PYTHONPATH, every process of the job imports this at start-up;
once pivotrl_hpc.runtime.worker is imported, a rollout worker's Reload waits for the version
and reports it, but never loads the weights: the engines keep the warm-start policy (v0)."""
import importlib.abc
import sys

TARGET = "pivotrl_hpc.runtime.worker"


def _patch(module) -> None:
    def reload_nothing(self, cmd):
        module.wait_for_version(self.store, "policy", cmd.version)
        self.version = cmd.version
        return {"version": cmd.version}, {}
    module.DeviceWorker._reload = reload_nothing


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


import importlib.util  # noqa: E402

sys.meta_path.insert(0, _AfterImport())
