"""moe_rt: a framework-agnostic runtime for Mixture-of-Experts layers.

Router ops, single-GPU dispatch/combine and expert parallelism over NCCL, as CUDA kernels compiled at run
time; arrays from torch, JAX, CuPy or NumPy go in and come back out in the same framework by DLPack.
CPU arrays run the NumPy reference of every op. Autograd-aware wrappers: ``moe_rt.torch``, ``moe_rt.jax``.
"""
from moe_rt._version import __version__
from moe_rt._comm import Communicator, NcclError, get_unique_id, nccl_version
from moe_rt import _common_ops  # noqa: F401 - registers the utility kernels
from moe_rt._errors import check, set_debug
from moe_rt.router import (aux_loss, aux_loss_backward, qb_histogram_accumulate, scores_for_aux_loss,
                           scores_for_aux_loss_backward, topk_indices_with_score, topk_with_score,
                           topk_with_score_backward, topk_with_score_qb, update_expert_bias_with_quantile)
from moe_rt.permutation import (Plan, combine, combine_backward, dispatch, dispatch_backward, make_plan,
                                sort_chunks, sort_chunks_backward)
from moe_rt.fp8 import dequantize_fp8, dispatch_fp8, quantize_fp8
from moe_rt.ep import EpGroup, Handle
from moe_rt.ep_ll import LowLatencyGroup, LowLatencyHandle
from moe_rt import bootstrap  # noqa: F401 - unique-id helpers: moe_rt.bootstrap.init_communicator, ...
from moe_rt._jit import l2_fetch_granularity

__all__ = [
    "__version__",
    # router
    "topk_with_score", "topk_with_score_backward", "topk_indices_with_score", "scores_for_aux_loss",
    "scores_for_aux_loss_backward", "aux_loss", "aux_loss_backward", "topk_with_score_qb", "qb_histogram_accumulate",
    "update_expert_bias_with_quantile",
    # dispatch/combine on one GPU
    "Plan", "make_plan", "dispatch", "combine", "dispatch_backward", "combine_backward", "sort_chunks",
    "sort_chunks_backward",
    # FP8: block quantization and dispatch with scales
    "quantize_fp8", "dequantize_fp8", "dispatch_fp8",
    # expert parallelism
    "EpGroup", "Handle", "LowLatencyGroup", "LowLatencyHandle", "bootstrap",
    # NCCL
    "Communicator", "NcclError", "get_unique_id", "nccl_version",
    # bad routing on CUDA: raise what the kernels recorded (moe_rt._errors); the eager-check switch
    "check", "set_debug",
    # device setting (opt-in)
    "l2_fetch_granularity",
]
