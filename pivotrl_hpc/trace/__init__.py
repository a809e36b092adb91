"""Run trace: one HDF5 file per run, appended live (SWMR), read offline. See docs/trace.md.

Needs only numpy and h5py (no torch, MPI or vLLM).
"""
from .reader import Trace, open_trace
from .schema import TABLES, TRUNCATION_MARKER
from .writer import TraceWriter

__all__ = ["TABLES", "TRUNCATION_MARKER", "Trace", "TraceWriter", "open_trace"]
