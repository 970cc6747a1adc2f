"""Measured launch configurations per GPU generation (data files, read through importlib.resources)."""
