"""Registration of moe_rt's torch operators (namespace ``moe_rt``) through ``torch.library.Library``.

:func:`custom_op` has the decorator interface of ``torch.library.custom_op`` (schema inferred from the type
hints; ``.register_fake``; ``.register_autograd``) but defines the operator with ``Library.define`` and
registers the Python function for the CPU and CUDA dispatch keys directly. That skips the per-call wrapper
layers of ``torch.library.custom_op`` (its Python backend wrapper and output-aliasing check), which cost
tens to hundreds of microseconds a call, more than the kernels at small sizes. The functions must not
return their inputs or views of them (they return fresh moe_rt results).
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("moe_rt", "FRAGMENT")


class Op:
    """A registered operator: call it like the function; ``register_fake`` and ``register_autograd`` as in
    ``torch.library``."""

    def __init__(self, qualname: str):
        self.qualname = qualname
        ns, name = qualname.split("::")
        self._op = getattr(getattr(torch.ops, ns), name).default

    def __call__(self, *args):
        return self._op(*args)

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=_lib)
        return fn

    def register_autograd(self, backward, *, setup_context):
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=_lib)


def custom_op(qualname: str, *, mutates_args=()):
    """Decorator: define ``qualname`` (``"moe_rt::name"``) from the function's type hints and register the
    function as its CPU and CUDA kernel."""
    ns, name = qualname.split("::")
    if ns != "moe_rt":
        raise ValueError(f"operators live in the moe_rt namespace, got {qualname!r}")

    def deco(fn):
        _lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        for key in ("CPU", "CUDA"):
            _lib.impl(name, fn, key)
        return Op(qualname)

    return deco
