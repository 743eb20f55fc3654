"""Compatibility layers: Megatron-Core on machines it was not written for (``cpu``: no CUDA)."""
