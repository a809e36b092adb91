"""Checkpoints of a run: the folder layout (layout.py) and the controller's state (state.py);
the training ranks' part is runtime/checkpoint.py, the loop's controller/checkpointing.py."""
