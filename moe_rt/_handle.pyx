# cython: language_level=3
"""The expert-parallel handle: one uint8 buffer (device or host) holding every array of a plan, plus
the layout that names its parts.

The layout is defined once here (:data:`REGIONS`, :func:`layout`) and mirrored for C callers in
``include/moe_rt/moe_rt.h`` (the test suite checks that the two agree). Every region starts on a
256-byte boundary, in the order of :data:`REGIONS`.
"""
from libc.stdint cimport int64_t

ALIGN = 256

# name, dtype, element count as a function of the sizes (R ranks, L local experts, Tmax tokens per
# rank, K top-k, P per-pair capacity, rows received rows, N expert-major rows).
REGIONS = (
    ("meta", "int32", "5*R + 10"),
    ("routing", "int32", "Tmax*K + 1"),
    ("send_tok", "int32", "R*P"),
    ("send_pos", "int32", "R*Tmax"),
    ("recv_tok", "int32", "R*P"),
    ("recv_local", "int32", "rows*K"),
    ("recv_wk", "float32", "rows*K"),
    ("dst_row", "int32", "rows*K"),
    ("src_slot", "int32", "N"),
    ("seg_start", "int32", "L + 1"),
    ("expert_counts", "int32", "L"),
    ("tokens_per_expert", "int32", "L"),
)

# Offsets inside the int32 ``meta`` region (R = ranks).
META_FIELDS = (
    ("send_counts", "0", "R"),          # tokens this rank sends to each rank (before pair-capacity drops)
    ("recv_counts", "R", "R"),          # tokens each rank sends to this one (before drops)
    ("recv_slots", "2*R", "R"),         # local expert slots in the kept rows from each rank
    ("send_off", "3*R", "R + 1"),       # first row of each destination in the send buffer (own = skipped)
    ("recv_off", "4*R + 1", "R + 1"),   # first received row of each source
    ("pair_overflow", "5*R + 2", "1"),
    ("expert_overflow", "5*R + 3", "1"),
    ("total_slots", "5*R + 4", "1"),    # local expert slots received (before capacity drops)
    ("num_tokens", "5*R + 5", "1"),     # T of this rank
    ("recv_rows", "5*R + 6", "1"),      # rows received (kept)
    ("send_rows", "5*R + 7", "1"),      # rows sent to other ranks (kept)
)

_ITEM = {"int32": 4, "float32": 4}
_FIXED = ("meta", "routing", "send_tok", "send_pos", "recv_tok")


def _count(expr, sizes):
    return int(eval(expr, {"__builtins__": {}}, dict(sizes)))


# REGIONS with each count as a function of the sizes, compiled once (layout runs in every exact-mode prepare)
_COUNTS = tuple((name, dt, _ITEM[dt], eval(f"lambda R, L, Tmax, K, P, rows, N: int({expr})",
                                           {"__builtins__": {"int": int}}))
                for name, dt, expr in REGIONS)


def layout(int R, int L, int Tmax, int K, int P, long long rows, long long N):
    """``({name: (byte_offset, dtype, count)}, total_bytes)`` for the given sizes."""
    out = {}
    cdef long long off = 0
    for name, dt, item, count in _COUNTS:
        n = count(R, L, Tmax, K, P, rows, N)
        out[name] = (off, dt, n)
        off += n * item
        off = (off + ALIGN - 1) // ALIGN * ALIGN
    return out, off


def fixed_bytes(int R, int Tmax, int K, int P):
    """Bytes of the leading regions that depend on the routing only (meta .. recv_tok)."""
    lay, _ = layout(R, 1, Tmax, K, P, 0, 0)
    return lay["recv_local"][0]


# META_FIELDS' offsets as functions of R, compiled once (exact-mode prepare reads two fields per call)
_META_AT = {name: eval(f"lambda R: int({off})", {"__builtins__": {"int": int}}) for name, off, n in META_FIELDS}


def meta_index(str field, int R):
    f = _META_AT.get(field)
    if f is None:
        raise KeyError(field)
    return f(R)


cdef class Handle:
    """A plan made by ``EpGroup.prepare``: the buffer (``buffer``, uint8, 1-D; CuPy on CUDA, NumPy on the
    CPU reference path), its ``layout`` ({name: (offset, dtype, count)}), the id of the group it belongs
    to, its ``mode`` ('exact' or 'capacity') and its static ``sizes`` (dict of ints).

    ``view(name)`` gives a region as a typed array (no copy). The handle exports its buffer through
    DLPack (``__dlpack__``), so a framework can carry it as a uint8 array. ``close()`` drops the buffer;
    using a closed handle raises ValueError.
    """
    cdef readonly object buffer
    cdef readonly dict layout
    cdef readonly long long group_id
    cdef readonly str mode
    cdef readonly dict sizes
    cdef readonly bint closed
    cdef public object state

    def __init__(self, buffer, dict layout, long long group_id, str mode, dict sizes):
        if mode not in ("exact", "capacity"):
            raise ValueError(f"mode must be 'exact' or 'capacity', got {mode!r}")
        self.buffer = buffer
        self.layout = layout
        self.group_id = group_id
        self.mode = mode
        self.sizes = dict(sizes)
        self.closed = False
        self.state = {}

    def view(self, str name):
        """Region ``name`` as a 1-D int32/float32 array over the buffer (no copy)."""
        if self.closed:
            raise ValueError("the handle is closed")
        try:
            off, dt, n = self.layout[name]
        except KeyError:
            raise KeyError(f"no region {name!r} in the handle layout") from None
        return self.buffer[off:off + n * _ITEM[dt]].view(dt)

    def check(self, long long group_id, str op="op"):
        """Raise ValueError unless the handle is open and belongs to group ``group_id``."""
        if self.closed:
            raise ValueError(f"{op}: handle is closed")
        if group_id != self.group_id:
            raise ValueError(f"{op}: handle belongs to EP group {self.group_id}, not to this group "
                             f"({group_id})")

    def overflow(self):
        """True if rows were dropped (capacity mode): reads two flags from the buffer, which for a device
        buffer waits for the work queued before it (a sync without a deadline; prefer
        ``EpGroup.check_overflow``, which has one)."""
        m = self.view("meta")
        if hasattr(m, "get"):
            m = m.get()
        R = self.sizes["R"]
        return bool(m[meta_index("pair_overflow", R)] or m[meta_index("expert_overflow", R)])

    @property
    def nbytes(self):
        return 0 if self.buffer is None else int(self.buffer.nbytes)

    def close(self):
        """Release the buffer (idempotent)."""
        self.closed = True
        self.buffer = None
        self.state = {}

    def __dlpack__(self, *args, **kwargs):
        if self.closed:
            raise ValueError("the handle is closed")
        return self.buffer.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        if self.closed:
            raise ValueError("the handle is closed")
        return self.buffer.__dlpack_device__()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.nbytes} bytes"
        return (f"Handle(group={self.group_id}, mode={self.mode!r}, rows={self.sizes.get('N')}, "
                f"{state})")
