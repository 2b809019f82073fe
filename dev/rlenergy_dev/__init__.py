"""Test doubles shipped with the agent: the stand-in NVML driver (``standin``)."""
