"""moe_rt: a framework-agnostic runtime for Mixture-of-Experts layers.

Router ops, single-GPU dispatch/combine and expert parallelism over NCCL, as CUDA kernels compiled at run
time; arrays from torch, JAX, CuPy or NumPy go in and come back out in the same framework by DLPack.
CPU arrays run the NumPy reference of every op.
"""
from moe_rt._version import __version__
from moe_rt._comm import Communicator, NcclError, get_unique_id, nccl_version
from moe_rt import _common_ops  # noqa: F401 - registers the utility kernels

__all__ = ["__version__", "Communicator", "NcclError", "get_unique_id", "nccl_version"]
