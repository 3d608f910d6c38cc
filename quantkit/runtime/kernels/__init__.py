"""Triton kernels, one per file, each with its launcher (shape and dtype checks) and a plain-torch reference."""
