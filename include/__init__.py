"""Device headers shared by moe_rt's kernels (package data)."""
