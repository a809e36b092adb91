"""pivotrl-hpc: resource-shiftable RL post-training with GenRM."""
__version__ = "0.1.0"
