"""CUDA sources of moe_rt's kernels, compiled at run time (package data)."""
