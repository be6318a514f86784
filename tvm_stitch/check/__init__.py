"""Checks of scheduled kernels: they build on their own, their modeled traffic."""
