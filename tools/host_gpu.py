"""The ``--gpu`` mode of tools/profile_ep_host.py and tools/profile_ll_host.py: where the host time of an eager
expert-parallel op goes on real GPUs (one process per GPU under moe_rt.launch).

Per op it gives (1) the median host time of the whole call as moe_rt/bench/_lib.py's ``time_host`` measures it
(perf_counter around one call, the result dropped inside the span, the stream synchronized between calls
outside it), beside the median wall and thread-CPU time of the same span (wall well above CPU: the thread
was blocked: a sleep, a driver lock, a wait), and the device (CUDA-event) time; (2) a breakdown: the functions
on the op's path wrapped (monkeypatched for the breakdown alone, removed after it) with perf_counter_ns
accumulators: every function and method of moe_rt's EP modules, the kernel launches (``_jit.launch_raw`` and
the driver's ``cuLaunchKernel``, per kernel), the allocations (CuPy's pool through its allocator hook,
``Call.empty``/``scratch``, ``torch.empty``, pinned memory), DLPack and array import/export, the CUDA runtime
calls moe_rt makes from Python (memcpys, synchronizes, event queries, ``streamIsCapturing``, pointer
attribute queries), ``time.sleep``, the communicator's calls (NCCL transport), CuPy's array functions and the
garbage collector; each item's own time (its span less the wrapped calls inside it), count per call and
span, the op's unaccounted remainder (its own lines and whatever was not wrapped) and the wrappers' estimated
cost; (3) a cProfile of the calls, the top by tottime. Rank 0 reports; the other ranks run the same calls in
lockstep. Reference floors on the same machine: a CuPy pool (and torch caching allocator) allocation + free
of the op's big sizes, a pinned host allocation, and the direct transport's barrier kernel through
``DirectTransport.barrier`` (one core call).

The wrapper (:class:`Breakdown`) needs no GPU: the tests run it against the stand-in device.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import types

import numpy as np

# moe_rt modules whose functions and class methods (defined there) the breakdown wraps
MODULES = ("moe_rt.ep", "moe_rt.ep_ll", "moe_rt._ep_rows", "moe_rt._ep_direct", "moe_rt._ep_nccl",
           "moe_rt._ep_mixed", "moe_rt._ep_adapt", "moe_rt._arrays", "moe_rt._errors", "moe_rt._jit",
           "moe_rt.permutation", "moe_rt.fp8")
_DUNDERS = ("__init__", "__enter__", "__exit__", "__call__", "__missing__")
# functions the breakdown leaves alone: called while wrappers are being set up or only at import
_SKIP = {"moe_rt._jit": {"_dir", "kernels_dir", "include_dir", "source_hash", "say", "register", "registered"}}
# the CUDA runtime calls moe_rt makes from Python (CuPy's runtime module)
RUNTIME = ("memcpyAsync", "memcpy", "memsetAsync", "streamSynchronize", "deviceSynchronize", "streamQuery",
           "eventQuery", "eventSynchronize", "eventRecord", "eventCreateWithFlags", "streamIsCapturing",
           "pointerGetAttributes", "getDevice", "setDevice", "streamWaitEvent", "hostAlloc", "freeHost")
CUPY_FUNCS = ("empty", "zeros", "ascontiguousarray", "copyto", "from_dlpack", "asarray", "concatenate")
# cupy.ndarray is a Python subclass of CuPy's extension type: its kernels (copy, astype, fill, a slice
# assignment) and views can be wrapped
CUPY_NDARRAY = ("copy", "astype", "fill", "__setitem__", "__getitem__", "view", "reshape", "get", "__dlpack__")
TORCH_FUNCS = ("empty", "zeros", "from_dlpack")
TORCH_C = ("_from_dlpack", "_cuda_getCurrentRawStream")
TORCH_TENSOR = ("data_ptr", "is_contiguous", "get_device", "stride", "view", "numel", "dim", "__dlpack__",
                "__dlpack_device__")
COMM_METHODS = ("group_start", "group_end", "send", "recv", "all_gather", "all_reduce", "async_error")


def category(label: str) -> str:
    """The group an item of the breakdown belongs to (the table of categories)."""
    name = label.split("[")[0]
    short = name.rsplit(".", 1)[-1]
    if name in ("cuLaunchKernel", "_jit.launch_raw", "_jit.launch", "_jit.function",
                "_jit.function_ptr", "_jit._current_stream_ptr", "_jit.set_max_dynamic_shared") or name.startswith(
                    ("_core.ll_", "_core.ep_direct_", "_core.ep_prepare")):
        return "launch"
    if name.startswith("comm.") or name.startswith("_ep_nccl."):
        return "nccl"
    if name in ("cupy pool malloc", "Call.empty", "Call.scratch", "Call._torch_empty", "Call._fp8_empty",
                "torch.empty", "torch.zeros", "cupy.empty", "cupy.zeros", "cupy.cuda.alloc_pinned_memory"):
        return "alloc"
    if name.startswith("runtime.memc") or name.startswith("runtime.memset") or short == "copy_bytes":
        return "memcpy"
    if name.startswith("runtime.") or name in ("time.sleep", "ep._capturing") or short in (
            "_wait", "_check_transport", "failed_op", "raise_pending", "_read_meta"):
        return "sync/query"
    if short == "barrier":
        return "barrier"
    if name.startswith("cupy."):
        return "cupy"
    if name.startswith("torch."):
        return "torch"
    if name == "(gc)":
        return "gc"
    if "check" in short or short in ("_alive", "resolve_validate", "contiguous", "_fp32_weights", "as_f32",
                                     "_no_autograd", "_no_tracer", "_dispatch_weights", "_remember"):
        return "validation"
    if name.startswith(("Call.", "_arrays.", "_dlpack.")) or "dlpack" in name:
        return "arrays/dlpack"
    if name.startswith(("_ep_direct.", "_ep_rows.", "_ep_mixed.")):
        return "transport"
    return "python"


def _short(modname: str) -> str:
    return modname[len("moe_rt."):] if modname.startswith("moe_rt.") else modname


class Breakdown:
    """Wrappers with perf_counter_ns accumulators on the functions of an op's path, installed by
    :meth:`install` (monkeypatching module and class attributes; every binding of a wrapped function in
    moe_rt's modules and classes gets the wrapper) and removed by :meth:`uninstall` (every attribute as it
    was). :meth:`measure` runs one call under a root frame. Accumulators per label: ``[count, span ns, own
    ns]``; own = span less the spans of the wrapped calls inside it (a wrapper's own cost lands in its
    caller's own time: see :meth:`calibrate`). Only the installing thread is measured."""

    def __init__(self):
        self.acc: dict[str, list] = {}
        self.labels: list[str] = []  # every wrapped label, in install order
        self.skipped: list[str] = []  # attributes that could not be patched (extension types)
        self._patches: list = []  # (owner, name, had its own attribute, the original raw value)
        self._index = None
        self.overhead = (0.0, 0.0)  # calibrate(): ns per wrapped call, of it inside the span
        self._stack = [0]
        self._on = [False]
        self._tid = threading.get_ident()
        self._allocator = None
        self._gc = [0, 0, 0]  # start ns, collections, ns
        self.root_own = self.release_ns = self.total_ns = 0
        self.calls = 0
        self.installed = False

    # -- wrapping ------------------------------------------------------------------------------------
    def _acc(self, label):
        a = self.acc.get(label)
        if a is None:
            a = self.acc[label] = [0, 0, 0]
        return a

    def wrapper(self, f, label, key=None):
        """A function calling ``f`` and adding its span to ``label``'s accumulator (``key(args)``: a suffix
        ``[key]`` to the label per call, e.g. the kernel of a launch)."""
        stack, on, tid, ns, ident = self._stack, self._on, self._tid, time.perf_counter_ns, threading.get_ident
        acc = self._acc(label)
        accs = self.acc

        def wrapped(*a, **k):
            if not on[0] or ident() != tid:
                return f(*a, **k)
            stack.append(0)
            t0 = ns()
            try:
                return f(*a, **k)
            finally:
                dt = ns() - t0
                child = stack.pop()
                stack[-1] += dt
                if key is None:
                    c = acc
                else:
                    try:
                        lab = f"{label}[{key(a)}]"
                    except Exception:  # noqa: BLE001 - an unexpected call form: the label alone
                        lab = label
                    c = accs.get(lab)
                    if c is None:
                        c = accs[lab] = [0, 0, 0]
                c[0] += 1
                c[1] += dt
                c[2] += dt - child

        wrapped.__wrapped__ = f
        wrapped.__name__ = getattr(f, "__name__", label)
        wrapped.__qualname__ = getattr(f, "__qualname__", label)
        wrapped._breakdown_label = label
        return wrapped

    def _set(self, owner, name, value, instance=False):
        had = name in vars(owner) if hasattr(owner, "__dict__") else False
        raw = vars(owner)[name] if had else (getattr(owner, name) if instance else None)
        try:
            setattr(owner, name, value)
        except (TypeError, AttributeError):
            return False
        self._patches.append((owner, name, had or instance, raw))
        return True

    @staticmethod
    def _raw(owner, name):
        """``owner.name`` as stored: for a class, the descriptor found along its MRO (a staticmethod stays one)."""
        if isinstance(owner, type):
            for k in owner.__mro__:
                if name in vars(k):
                    return vars(k)[name]
            return None
        return getattr(owner, name, None)

    def patch(self, owner, name, label, key=None, everywhere=True):
        """Wrap ``owner.name`` (a module or class attribute: a function, builtin, staticmethod or
        classmethod) under ``label``; with ``everywhere``, also every other binding of the same object in
        moe_rt's modules and classes (``from x import f``; ``_wait = EpGroup._wait``). False when absent,
        wrapped already or not patchable (then listed in ``skipped``)."""
        raw = self._raw(owner, name)
        if raw is None or any(o is owner and n == name for o, n, _, _ in self._patches):
            return False
        inner = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if not callable(inner) or isinstance(inner, type) or hasattr(inner, "_breakdown_label"):
            return False
        w = self.wrapper(inner, label, key)
        if isinstance(raw, (staticmethod, classmethod)):
            w = type(raw)(w)
        if not self._set(owner, name, w):
            self.skipped.append(label)
            return False
        self.labels.append(label)
        if everywhere:
            for o, n in self._bindings().get(id(raw), ()):
                if o is not owner and self._raw(o, n) is raw:
                    self._set(o, n, w)
        return True

    def _bindings(self):
        """``{id(object): [(namespace, name)]}`` over moe_rt's modules and the classes defined in them (made
        once per install)."""
        if self._index is None:
            idx: dict = {}
            for name, mod in list(sys.modules.items()):
                if mod is None or not (name == "moe_rt" or name.startswith("moe_rt.")):
                    continue
                spaces = [mod] + [v for v in list(vars(mod).values())
                                  if isinstance(v, type) and getattr(v, "__module__", "") == name]
                for sp in spaces:
                    for n, v in list(vars(sp).items()):
                        if callable(v) or isinstance(v, (staticmethod, classmethod)):
                            idx.setdefault(id(v), []).append((sp, n))
            self._index = idx
        return self._index

    def patch_module(self, mod):
        """Every function defined in ``mod`` and every method (plain, static, class, and the dunders that run
        code per call) of the classes defined in it."""
        name = mod.__name__
        short = _short(name)
        skip = _SKIP.get(name, ())
        for n, v in list(vars(mod).items()):
            if n in skip:
                continue
            if isinstance(v, types.FunctionType) and v.__module__ == name:
                self.patch(mod, n, f"{short}.{n}")
            elif isinstance(v, type) and v.__module__ == name:
                self.patch_class(v, f"{short}.{v.__name__}")

    def patch_class(self, cls, prefix, names=None):
        for n, v in list(vars(cls).items()):
            if names is not None and n not in names:
                continue
            if n.startswith("__") and n not in _DUNDERS:
                continue
            if isinstance(v, (types.FunctionType, staticmethod, classmethod)):
                self.patch(cls, n, f"{prefix}.{n}")
        if names is not None:  # named ones inherited too
            for n in names:
                if n not in vars(cls) and self._raw(cls, n) is not None:
                    self.patch(cls, n, f"{prefix}.{n}", everywhere=False)

    def patch_allocator(self):
        """CuPy's allocations (every ``cupy.empty`` and the like reach the allocator hook): the current
        allocator wrapped."""
        import cupy

        cur = cupy.cuda.get_allocator()
        if cur is None:
            return False
        self._allocator = cur
        cupy.cuda.set_allocator(self.wrapper(cur, "cupy pool malloc"))
        self.labels.append("cupy pool malloc")
        return True

    def wrap_comm(self, holder, attr="comm"):
        """Replace ``holder.<attr>`` (a communicator) with a proxy whose calls are wrapped (``comm.<name>``);
        undone by :meth:`uninstall`."""
        comm = getattr(holder, attr, None)
        if comm is None:
            return
        bd = self

        class CommProxy:
            def __getattr__(self, name):
                return getattr(comm, name)

        proxy = CommProxy()
        for n in COMM_METHODS:
            if hasattr(comm, n):
                setattr(proxy, n, bd.wrapper(getattr(comm, n), f"comm.{n}"))
                if f"comm.{n}" not in self.labels:
                    self.labels.append(f"comm.{n}")
        self._set(holder, attr, proxy, instance=True)

    def install(self, groups=()):
        """Wrap everything (see the module notes); ``groups``: objects whose ``comm`` (and their transport's)
        is proxied."""
        import cupy
        from cupy.cuda import runtime

        from moe_rt import _arrays, _jit

        if self.installed:
            raise RuntimeError("the breakdown's wrappers are installed already")
        for name in MODULES:
            try:
                __import__(name)
            except ImportError:
                continue
        # the leaves first, under their own labels (whatever stands at the attribute: a stand-in too)
        fnames = {}

        def kernel_name(a):
            fn = a[0]
            n = getattr(fn, "name", None) or getattr(getattr(fn, "kernel", None), "name", None) or repr(fn)
            return str(n).split("(")[0]

        def driver_name(a):
            p = a[0]
            n = fnames.get(p)
            if n is None:
                for fn, ptr in list(_jit._ptrs.values()):
                    fnames[ptr] = kernel_name((fn,))
                n = fnames.get(p, hex(p))
            return n

        self.patch(_jit, "launch_raw", "_jit.launch_raw", key=kernel_name)
        from moe_rt import _core

        for n in ("ll_dispatch", "ll_combine", "ll_combine_bwd", "ep_direct_barrier", "ep_direct_dispatch",
                  "ep_direct_combine", "ep_prepare"):  # the core plans and launches (barrier + kernels)
            self.patch(_core, n, f"_core.{n}")
        if getattr(_jit, "_driver", None) is not None:
            self.patch(_jit._driver, "launch", "cuLaunchKernel", key=driver_name, everywhere=False)
        self.patch_class(_arrays.Call, "Call", names=("__init__", "_import", "out", "empty", "scratch",
                                                      "_torch_empty", "_fp8_empty", "__enter__", "__exit__"))
        from moe_rt import _dlpack

        for n in ("consume",):
            self.patch(_dlpack, n, f"_dlpack.{n}")
        for n in RUNTIME:
            self.patch(runtime, n, f"runtime.{n}")
        self.patch(cupy.cuda, "alloc_pinned_memory", "cupy.cuda.alloc_pinned_memory")
        for n in CUPY_FUNCS:
            self.patch(cupy, n, f"cupy.{n}", everywhere=False)
        for n in CUPY_NDARRAY:
            self.patch(cupy.ndarray, n, f"cupy.ndarray.{n}", everywhere=False)
        self.patch(time, "sleep", "time.sleep", everywhere=False)
        self.patch_allocator()
        torch = sys.modules.get("torch")
        if torch is not None:
            for n in TORCH_FUNCS:
                self.patch(torch, n, f"torch.{n}", everywhere=False)
            for n in TORCH_C:
                self.patch(torch._C, n, f"torch._C.{n}", everywhere=False)
            for n in TORCH_TENSOR:
                self.patch(torch.Tensor, n, f"torch.Tensor.{n}", everywhere=False)
        from moe_rt import _handle

        for n in ("layout", "meta_index"):
            self.patch(_handle, n, f"_handle.{n}")
        # then every function and method of the EP modules
        for name in MODULES:
            mod = sys.modules.get(name)
            if mod is not None:
                self.patch_module(mod)
        for g in groups:
            self.wrap_comm(g)
            t = getattr(g, "_transport", None)
            if t is not None:
                self.wrap_comm(t)
                nc = getattr(t, "nccl", None)
                if nc is not None:
                    self.wrap_comm(nc)
        gc.callbacks.append(self._gc_cb)
        self.installed = True
        self._on[0] = True
        return self

    def uninstall(self):
        """Every patched attribute as it was (in reverse order), the allocator and the GC hook removed."""
        self._on[0] = False
        for owner, name, had, raw in reversed(self._patches):
            if had:
                setattr(owner, name, raw)
            else:
                delattr(owner, name)
        self._patches = []
        self._index = None
        if self._allocator is not None:
            import cupy

            cupy.cuda.set_allocator(self._allocator)
            self._allocator = None
        if self._gc_cb in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        self.installed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.installed:
            self.uninstall()
        return False

    def _gc_cb(self, phase, info):
        if not self._on[0] or threading.get_ident() != self._tid:
            return
        if phase == "start":
            self._gc[0] = time.perf_counter_ns()
        elif self._gc[0]:
            self._gc[1] += 1
            self._gc[2] += time.perf_counter_ns() - self._gc[0]
            self._gc[0] = 0

    # -- measuring -----------------------------------------------------------------------------------
    def reset(self):
        for a in self.acc.values():
            a[0] = a[1] = a[2] = 0
        self._gc[:] = [0, 0, 0]
        self.root_own = self.release_ns = self.total_ns = self.calls = 0

    def measure(self, f):
        """One call of ``f()`` under a root frame, its result dropped in a second timed frame (time_host
        drops it inside its span). Returns the wall ns of both."""
        stack, ns = self._stack, time.perf_counter_ns
        stack[:] = [0]
        t0 = ns()
        r = f()
        t1 = ns()
        self.root_own += (t1 - t0) - stack[0]
        stack[:] = [0]
        t2 = ns()
        del r
        t3 = ns()
        self.release_ns += (t3 - t2) - stack[0]  # the wrapped calls inside (rare) count as theirs
        self.total_ns += (t1 - t0) + (t3 - t2)
        self.calls += 1
        return (t1 - t0) + (t3 - t2)

    def calibrate(self, n=20000):
        """``(ns per wrapped call in all, ns of it inside the wrapped span)``: a wrapped no-op against the bare
        one."""
        def noop():
            return None

        saved_acc, saved_labels = self.acc, list(self.labels)
        self.acc = {}
        w = self.wrapper(noop, "(calibration)")
        on = self._on[0]
        self._on[0] = True
        try:
            best_bare = best_w = None
            for _ in range(5):
                t = time.perf_counter_ns()
                for _ in range(n):
                    noop()
                bare = time.perf_counter_ns() - t
                self._stack[:] = [0]
                t = time.perf_counter_ns()
                for _ in range(n):
                    w()
                wr = time.perf_counter_ns() - t
                best_bare = bare if best_bare is None else min(best_bare, bare)
                best_w = wr if best_w is None else min(best_w, wr)
            inside = self.acc["(calibration)"][1] / self.acc["(calibration)"][0]
        finally:
            self._on[0] = on
            self.acc, self.labels = saved_acc, saved_labels
        return max(0.0, (best_w - best_bare) / n), inside

    def report(self, overhead_ns=(0.0, 0.0), every=False):
        """The accumulated calls as a dict: per call ``total_us`` (wall, wrapped), ``items`` (label, category,
        count, own and span us per call; sorted by own time; with ``every``, also the labels never called),
        ``categories`` (own us per call), ``unaccounted_us`` (the root's own time: the op's own lines and
        anything not wrapped, including the wrappers' cost outside their spans), ``gc``, ``release_us``, the
        number of wrapped calls and ``wrapper_overhead_us`` (that number times the calibrated cost)."""
        n = max(self.calls, 1)
        items = []
        for label, (c, span, own) in self.acc.items():
            if c == 0 and not every:
                continue
            if c == 0 and label not in self.labels:
                continue
            items.append({"label": label, "category": category(label), "count": c / n, "own_us": own / n / 1e3,
                          "span_us": span / n / 1e3})
        if self._gc[1] or every:
            items.append({"label": "(gc)", "category": "gc", "count": self._gc[1] / n, "own_us": self._gc[2] / n / 1e3,
                          "span_us": self._gc[2] / n / 1e3})
        items.sort(key=lambda it: -it["own_us"])
        cats: dict = {}
        for it in items:
            if it["label"] == "(gc)":
                continue  # inside the spans of the items it interrupted
            cats[it["category"]] = cats.get(it["category"], 0.0) + it["own_us"]
        wrapped_calls = sum(c for label, (c, _, _) in self.acc.items())
        return {"calls": self.calls, "total_us": self.total_ns / n / 1e3, "items": items,
                "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                "unaccounted_us": self.root_own / n / 1e3, "release_us": self.release_ns / n / 1e3,
                "wrapped_calls": wrapped_calls / n, "wrapper_ns": list(overhead_ns),
                "wrapper_overhead_us": wrapped_calls / n * overhead_ns[0] / 1e3}


def format_breakdown(rep, top=15) -> str:
    """A compact text table of :meth:`Breakdown.report`."""
    lines = [f"  wrapped: {rep['total_us']:.1f} us/call over {rep['calls']} calls; {rep['wrapped_calls']:.0f} wrapped "
             f"calls/call, est. wrapper cost {rep['wrapper_overhead_us']:.1f} us "
             f"({rep['wrapper_ns'][0]:.0f} ns each, {rep['wrapper_ns'][1]:.0f} inside the span)"]
    lines.append("  by category (own us/call): " + ", ".join(f"{k} {v:.1f}" for k, v in rep["categories"].items())
                 + f", unaccounted {rep['unaccounted_us']:.1f}, result release {rep['release_us']:.1f}")
    lines.append(f"  {'item':58s} {'category':13s} {'n/call':>6s} {'own us':>8s} {'span us':>8s}")
    shown = [it for it in rep["items"] if it["count"] > 0][:top]
    for it in shown:
        lines.append(f"  {it['label'][:58]:58s} {it['category']:13s} {it['count']:6.1f} {it['own_us']:8.1f} "
                     f"{it['span_us']:8.1f}")
    rest = [it for it in rep["items"] if it["count"] > 0][top:]
    if rest:
        lines.append(f"  {'(' + str(len(rest)) + ' more items)':58s} {'':13s} {sum(i['count'] for i in rest):6.1f} "
                     f"{sum(i['own_us'] for i in rest):8.1f}")
    lines.append(f"  {'(unaccounted: the op bodies, what is not wrapped)':58s} {'':13s} {1:6.1f} "
                 f"{rep['unaccounted_us']:8.1f}")
    lines.append(f"  {'(result release: the outputs dropped)':58s} {'':13s} {1:6.1f} {rep['release_us']:8.1f}")
    return "\n".join(lines)


def cprofile(f, n, sync, top=15):
    """cProfile of ``n`` calls of ``f()`` (the profiler on around each call, its result dropped inside;
    ``sync()`` between calls, outside): the ``top`` functions by tottime as dicts (us per call)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(n):
        prof.enable()
        f()
        prof.disable()
        sync()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in st.stats.items():
        where = func if file == "~" else f"{func} ({os.path.basename(file)}:{line})"
        rows.append({"function": where, "ncalls": nc / n, "tottime_us": tt / n * 1e6, "cumtime_us": ct / n * 1e6})
    rows.sort(key=lambda r: -r["tottime_us"])
    return rows[:top]


def format_cprofile(rows) -> str:
    lines = [f"  {'tottime us':>10s} {'cumtime us':>10s} {'n/call':>7s}  function"]
    for r in rows:
        lines.append(f"  {r['tottime_us']:10.1f} {r['cumtime_us']:10.1f} {r['ncalls']:7.1f}  {r['function'][:100]}")
    return "\n".join(lines)


def wall_cpu(f, n, sync, warmup=3):
    """Medians over ``n`` calls of ``f()`` (``sync()`` between, outside the span) of the wall and the calling
    thread's CPU time, in us."""
    for _ in range(warmup):
        f()
    sync()
    walls, cpus = [], []
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    for _ in range(n):
        c0, w0 = tt(), pc()
        f()
        w1, c1 = pc(), tt()
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
        sync()
    return float(np.median(walls)) / 1e3, float(np.median(cpus)) / 1e3


def breakdown_op(bd, f, n, sync, warmup=3):
    """``bd.report()`` of ``n`` calls of ``f()`` (``sync()`` between, outside), after ``warmup`` wrapped calls."""
    for _ in range(warmup):
        bd.measure(f)
        sync()
    bd.reset()
    for _ in range(n):
        bd.measure(f)
        sync()
    return bd.report(bd.overhead)


def profile_ops(ops, *, n, sync, rank0, time_host=None, time_event=None, top=15, cprofile_top=15, groups=(),
                out=print, title=""):
    """The per-op profile: for each ``name -> f`` of ``ops``: ``time_host(f)`` and ``time_event(f)`` (us;
    None: skipped), the wall and CPU medians, then (rank 0 alone wraps and profiles; every rank runs the
    same calls) the breakdown and the cProfile. Returns the rows (rank 0's are complete)."""
    rows = []
    for name, f in ops.items():
        row = {"op": name}
        row["host_us"] = time_host(f) if time_host is not None else None
        row["event_us"] = time_event(f) if time_event is not None else None
        row["wall_us"], row["cpu_us"] = wall_cpu(f, n, sync)
        if rank0:
            bd = Breakdown()
            bd.overhead = bd.calibrate()
            bd.install(groups)
            try:
                row["breakdown"] = breakdown_op(bd, f, n, sync)
            finally:
                bd.uninstall()
            row["cprofile"] = cprofile(f, n, sync, cprofile_top)
            out(f"\n### {name}{title}: host {_us(row['host_us'])} us (time_host), wall {row['wall_us']:.1f} / "
                f"thread CPU {row['cpu_us']:.1f} us (medians), device {_us(row['event_us'])} us (CUDA events)")
            out(format_breakdown(row["breakdown"], top))
            out(f"  cProfile, {n} calls, top {cprofile_top} by tottime (us per call):")
            out(format_cprofile(row["cprofile"]))
        else:
            for _ in range(3 + n):  # the breakdown's calls
                f()
                sync()
            for _ in range(n):  # the cProfile's
                f()
                sync()
        rows.append(row)
    return rows


def _us(v):
    return "-" if v is None else f"{v:.1f}"


def summary_table(rows) -> str:
    """One line per op: the whole call's times."""
    lines = [f"{'op':22s} {'mode':9s} {'host us':>8s} {'wall us':>8s} {'cpu us':>8s} {'event us':>8s} "
             f"{'wrapped':>8s} {'unacc.':>7s}  ranks' host us"]
    for r in rows:
        b = r.get("breakdown") or {}
        lines.append(f"{r['op']:22s} {r.get('mode', '-'):9s} {_us(r['host_us']):>8s} {r['wall_us']:8.1f} "
                     f"{r['cpu_us']:8.1f} {_us(r['event_us']):>8s} {_us(b.get('total_us')):>8s} "
                     f"{_us(b.get('unaccounted_us')):>7s}  "
                     + " ".join(_us(v) for v in r.get("host_us_ranks", [])))
    return "\n".join(lines)


def digest(rows, top=5) -> str:
    """Two lines per op (the end of a run's output): its categories and its top items by own time."""
    lines = []
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        cats = ", ".join(f"{k} {v:.0f}" for k, v in b["categories"].items() if v >= 0.5)
        lines.append(f"{r['op']} {r.get('mode', '')}: host {_us(r['host_us'])}, wrapped {b['total_us']:.0f} "
                     f"(est. wrapper cost {b['wrapper_overhead_us']:.0f}); {cats}, unaccounted "
                     f"{b['unaccounted_us']:.0f}, release {b['release_us']:.0f}")
        items = [it for it in b["items"] if it["count"] > 0][:top]
        lines.append("    top: " + "; ".join(f"{it['label']} {it['own_us']:.1f} ({it['count']:g}x)" for it in items))
    return "\n".join(lines)


# -- GPU runs ----------------------------------------------------------------------------------------------

def add_arguments(ap, ops, tokens, what):
    """The GPU mode's arguments (a group of ``ap``): --gpu (``what``: what it profiles), -n, --tokens (default
    ``tokens``), --ops (``ops``), --iters, --top, --json; returns the group."""
    gp = ap.add_argument_group("GPU mode (--gpu): real GPUs, one rank each (tools/host_gpu.py)")
    gp.add_argument("--gpu", action="store_true", help=f"profile on real GPUs: per op the median host time "
                    f"(time_host), wall and thread CPU time, {what}, a breakdown by wrapped function and a "
                    "cProfile; launches itself on -n GPUs unless run under tools/launch.py")
    gp.add_argument("-n", "--nproc", type=int, default=int(os.environ.get("MOE_RT_BENCH_EP_NPROC", "2")),
                    help="ranks (one GPU each) when this script launches itself (default MOE_RT_BENCH_EP_NPROC "
                         "or 2)")
    gp.add_argument("--tokens", type=int, default=tokens, help=f"tokens per rank T (default {tokens})")
    gp.add_argument("--ops", nargs="+", default=list(ops), choices=list(ops), help="ops to profile")
    gp.add_argument("--iters", type=int, default=50, help="calls per measurement (default 50)")
    gp.add_argument("--top", type=int, default=15, help="rows of each breakdown and cProfile (default 15)")
    gp.add_argument("--json", default=None, help="write the results to this file (rank 0)")
    return gp


def check_arguments(ap, a):
    """Refuse (``ap.error``, status 2) what the GPU mode cannot take: counts below 1, the stand-in's
    --profile with --gpu."""
    for name in ("calls", "nproc", "tokens", "iters", "top"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}: expected a positive number")
    if a.gpu and a.profile is not None:
        ap.error("--profile: the stand-in's; --gpu profiles every op")


def timers(rank, iters, stream):
    """``(time_host, time_event)`` of a rank: moe_rt/bench/_lib.py's time_host and time_cuda (us) on ``stream``,
    every rank synchronized first."""
    from moe_rt.bench import _lib as benchlib

    def time_host(f):
        rank.barrier()
        return benchlib.time_host(f, iters=iters, warmup=10, stream=stream)

    def time_event(f):
        rank.barrier()
        return 1e3 * benchlib.time_cuda(f, iters=min(iters, 20), warmup=3, stream=stream)

    return time_host, time_event


def finish(rows, fl, m, json_path, extra=()):
    """Rank 0's end of a run: the summary table, the digest, ``extra`` lines, the floors; the JSON file."""
    print("\n## summary (us per call; host: time_host's median; wall, cpu: the same span's medians; event: "
          "CUDA events; wrapped: with the breakdown's wrappers; unacc.: its unaccounted part)")
    print(summary_table(rows))
    print("by op (own us per call; the breakdown's categories and top items):")
    print(digest(rows))
    for line in extra:
        print(line)
    print(format_floors(fl))
    if json_path:
        write_json(json_path, {"meta": m, "floors": fl, "rows": rows})


def relaunch(script, argv, nproc, timeout=600) -> int:
    """Run ``script`` on ``nproc`` local GPUs under moe_rt.launch (this checkout's moe_rt importable), as
    moe_rt/bench/ep.py launches itself."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + ([os.environ["PYTHONPATH"]]
                                                                if os.environ.get("PYTHONPATH") else [])))
    cmd = [sys.executable, "-m", "moe_rt.launch", "-n", str(nproc), "--timeout", str(timeout),
           os.path.abspath(script), *argv]
    return subprocess.call(cmd, env=env)


def parse(parser, argv):
    """``(parser, args)`` of a profiler's parser, the GPU mode's values checked."""
    ap = parser()
    a = ap.parse_args(argv)
    check_arguments(ap, a)
    return ap, a


def run(ap, a, argv, script, rank_main) -> int:
    """The GPU mode of a profiler: see :func:`start`; under the launcher ``rank_main(a)``."""
    st = start(ap.prog, script, argv, a.nproc)
    return st if st is not None else rank_main(a)


def start(prog, script, argv, nproc) -> int | None:
    """The GPU mode's start: no GPU: exit status 2 with one line; outside the launcher: launch ``nproc``
    ranks and return the launcher's status; under it (WORLD_SIZE set): None (run this rank)."""
    from moe_rt import _jit

    why = _jit.no_gpu_reason()
    if why is not None:
        sys.stderr.write(f"{prog}: --gpu: {why}\n")
        return 2
    if "WORLD_SIZE" in os.environ:
        return None
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if n < nproc:
        sys.stderr.write(f"{prog}: {nproc} ranks need {nproc} CUDA GPUs, found {n}\n")
        return 2
    return relaunch(script, argv, nproc)


class Rank:
    """This rank under the launcher: the device, torch.distributed and a moe_rt communicator (as
    moe_rt/bench/ep.py makes them), a host barrier, and gathers of a float from every rank."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        from moe_rt.bench.ep import _init_rank

        self.rank, self.world, self.dev, self.comm = _init_rank()
        self.torch, self.dist = torch, dist
        self._bar = torch.zeros(1, device="cuda")

    def barrier(self):
        import cupy

        self.torch.cuda.synchronize()
        cupy.cuda.Device().synchronize()
        self.dist.all_reduce(self._bar)
        self.torch.cuda.synchronize()

    def gather(self, v):
        t = self.torch.tensor([float("nan") if v is None else float(v)], device="cuda", dtype=self.torch.float64)
        out = [self.torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(out, t)
        return [float(o.item()) for o in out]

    def close(self):
        self.barrier()
        self.comm.close()
        self.dist.destroy_process_group()

    def inputs(self, T, E, H, K):
        """This rank's EP inputs as moe_rt/bench/ep.py makes them (seed 1234 + rank): CuPy views ``(x [T,H]
        bf16, topk_idx [T,K] int32 (distinct experts), topk_weights [T,K] fp32)``."""
        import cupy

        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(1234 + self.rank)
        idx = torch.topk(torch.rand(T, E, device="cuda", generator=gen), K, dim=1).indices.to(torch.int32)
        w = torch.rand(T, K, device="cuda", generator=gen)
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        torch.cuda.synchronize()
        return cupy.from_dlpack(x), cupy.from_dlpack(idx), cupy.from_dlpack(w)


def floors(rank, sizes, iters, transport=None, stream=None):
    """Reference floors (us, medians of ``iters``): a CuPy pool and a torch caching-allocator allocation +
    free of each of ``sizes`` (bytes), a pinned host allocation + free, and (given a DirectTransport) one
    barrier kernel through ``DirectTransport.barrier`` (one core call): every rank launches the same
    barriers."""
    import cupy
    import torch

    stream = stream or cupy.cuda.get_current_stream()
    out = {}

    def med(f, sync=None):
        for _ in range(5):
            f()
        if sync:
            sync()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            f()
            ts.append(time.perf_counter_ns() - t0)
            if sync:
                sync()
        return float(np.median(ts)) / 1e3

    for nb in sizes:
        mb = f"{nb / 1e6:.0f} MB"
        out[f"cupy pool alloc+free {mb}"] = med(lambda: cupy.empty(nb, np.uint8))
        out[f"torch.empty+free {mb}"] = med(lambda: torch.empty(nb, dtype=torch.uint8, device="cuda"))
    out["cupy pinned alloc+free 256 B"] = med(lambda: cupy.cuda.alloc_pinned_memory(256))
    if transport is not None:  # one core call: plan looked up, the barrier launched
        out["barrier kernel: DirectTransport.barrier (core)"] = med(lambda: transport.barrier(stream, "dispatch"),
                                                                    stream.synchronize)
    rank.barrier()
    return out


def format_floors(fl) -> str:
    return "floors (us, medians): " + "; ".join(f"{k} {v:.1f}" for k, v in fl.items())


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def meta(rank, **kw):
    from moe_rt.bench import _lib as benchlib

    m = {"device": benchlib.device_name(), "ranks": rank.world, "commit": benchlib.git_commit(),
         "threads": [t.name for t in threading.enumerate()]}
    m.update(kw)
    return m
