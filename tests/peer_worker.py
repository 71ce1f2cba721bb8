"""Per-rank worker of tests/test_c_peer.py's GPU tests; run under the launcher, one process per GPU:

    python tools/launch.py -n R tests/peer_worker.py exchange|timeout

exchange (any R >= 2): peer buffers made through the C ABI (moe_rt_peer_buffer_*, loaded with ctypes from the
library moe_rt._core uses, so the communicator of moe_rt.bootstrap is the core's) over every rank and over this
rank's half of the ranks, zeroed or poisoned, of an odd size, and one without a communicator. Each rank writes
words (source, reader, index) into every mapped peer's buffer through the device table; each checks what it
received, what nobody wrote (zero or poison), the host array and the table; then every mapping is closed and every
buffer destroyed. Prints "ALL OK".

timeout (R = 2): rank 0 makes a peer buffer that rank 1 never makes: MOE_RT_ERROR_TIMEOUT within the deadline, its
message naming the op, the communicator aborted (moe_rt_comm_aborted) and released by the Python layer. Prints
"TIMEOUT OK" on rank 0.
"""
import ctypes as C
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DEV = int(os.environ.get("LOCAL_RANK", RANK))
TIMEOUT = 10
POISON = 0xABABABAB

PUT = r"""
extern "C" __global__ void put(const long long* table, int lo, int hi, int me, int n) {
  for (int p = lo; p < hi; ++p) {
    int* dst = (int*)table[p];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
      dst[me * n + i] = me * 1000003 + p * 1009 + i;
  }
}
"""


def log(*a):
    print(*a, flush=True)


def ok(lib, st):
    if st != 0:
        raise RuntimeError(f"{lib.moe_rt_status_name(st).decode()}: {lib.moe_rt_last_error().decode()}")


def setup():
    import cupy as cp

    cp.cuda.Device(DEV).use()
    from moe_rt import _core, _jit
    from moe_rt.bootstrap import init_communicator
    from test_c_peer import load

    comm = init_communicator(method="file")
    _core.device(DEV)  # the kernel cache folder's manifest lists this device's architecture
    lib = load(_core.LIB_PATH)  # the same library (and NCCL) as the communicator's
    ctx = C.c_void_p()
    ok(lib, lib.moe_rt_context_create(str(_jit.cache_dir()).encode(), DEV, C.byref(ctx)))
    return cp, comm, lib, ctx


def barrier(cp, comm, s):
    x = cp.ones(1, cp.int32)
    comm.all_reduce(x.data.ptr, x.data.ptr, 1, "int32", s.ptr)
    s.synchronize()
    assert int(x.get()[0]) == WORLD


def info_of(lib, b):
    from test_c_peer import PeerInfo

    info = PeerInfo()
    ok(lib, lib.moe_rt_peer_buffer_get_info(b, C.byref(info)))
    return info, [info.ptrs[r] or 0 for r in range(info.nranks)]


def words(cp, addr, n):
    mem = cp.cuda.UnownedMemory(addr, 4 * n, None, DEV)
    return cp.ndarray((n,), np.uint32, cp.cuda.MemoryPointer(mem, 0))


def exchange(cp, comm, lib, ctx):
    R, me = WORLD, RANK
    put = cp.RawKernel(PUT, "put")
    s = cp.cuda.Stream(non_blocking=True)
    half = max(R // 2, 1)
    nlo = me // half * half
    n = 37  # words each source writes
    nbytes = 4 * n * R + 13  # odd: the tail [4nR, nbytes) is nobody's
    cases = [(0, R, 1), (nlo, nlo + half, 0), (0, R, 0), (nlo, nlo + half, 1)]
    bufs = []
    for lo, hi, zero in cases:
        b = C.c_void_p()
        ok(lib, lib.moe_rt_peer_buffer_create(ctx, comm.handle, nbytes, zero, lo, hi, s.ptr, 60000, C.byref(b)))
        bufs.append(b)
        info, ptrs = info_of(lib, b)
        assert (info.nranks, info.rank, info.peer_lo, info.peer_hi, info.nbytes) == (R, me, lo, hi, nbytes)
        assert info.local and info.local % 256 == 0 and ptrs[me] == info.local
        inside = [ptrs[r] for r in range(lo, hi)]
        assert all(inside) and len(set(inside)) == hi - lo, ptrs
        assert all(ptrs[r] == 0 for r in range(R) if not lo <= r < hi), ptrs
        mem = cp.cuda.UnownedMemory(info.table, 8 * R, None, DEV)
        table = cp.ndarray((R,), np.int64, cp.cuda.MemoryPointer(mem, 0))
        s.synchronize()
        np.testing.assert_array_equal(table.get(), np.array(ptrs, np.int64))
        mine = words(cp, info.local, nbytes // 4)
        if zero:
            with s:
                assert int(cp.count_nonzero(mine).get()) == 0
        else:
            cp.cuda.runtime.memsetAsync(info.local, 0xAB, nbytes, s.ptr)
        s.synchronize()
        barrier(cp, comm, s)  # every rank's buffer is ready before anyone writes into it
        with s:
            put((2,), (64,), (info.table, np.int32(lo), np.int32(hi), np.int32(me), np.int32(n)))
        s.synchronize()
        barrier(cp, comm, s)  # every write has landed
        with s:
            got = mine.get(stream=s)
        idle = 0 if zero else POISON
        for src in range(R):
            seg = got[src * n:(src + 1) * n]
            want = (src * 1000003 + me * 1009 + np.arange(n)).astype(np.uint32) if lo <= src < hi else \
                np.full(n, idle, np.uint32)
            np.testing.assert_array_equal(seg, want, err_msg=f"case {(lo, hi, zero)}: words from rank {src}")
        np.testing.assert_array_equal(got[R * n:], np.full(len(got) - R * n, idle, np.uint32))
        log(f"case lo={lo} hi={hi} zero={zero} ok")
    # without a communicator: this rank alone
    b = C.c_void_p()
    ok(lib, lib.moe_rt_peer_buffer_create(ctx, None, 100, 1, 0, 1, s.ptr, 1000, C.byref(b)))
    info, ptrs = info_of(lib, b)
    assert (info.nranks, info.rank, info.peer_lo, info.peer_hi) == (1, 0, 0, 1) and ptrs == [info.local]
    s.synchronize()
    ok(lib, lib.moe_rt_peer_buffer_destroy(b))
    # teardown: every rank is done with every buffer, then every mapping closed, then (device idle) the frees
    barrier(cp, comm, s)
    for b, (lo, hi, _) in zip(bufs, cases):
        ok(lib, lib.moe_rt_peer_buffer_close_mappings(b))
        ok(lib, lib.moe_rt_peer_buffer_close_mappings(b))  # idempotent
        info, ptrs = info_of(lib, b)
        assert ptrs == [info.local if r == me else 0 for r in range(R)], ptrs
    cp.cuda.Device().synchronize()
    barrier(cp, comm, s)
    for b in bufs:
        ok(lib, lib.moe_rt_peer_buffer_destroy(b))
    ok(lib, lib.moe_rt_peer_buffer_destroy(None))


def timeout(cp, comm, lib, ctx):
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(WORLD, cp.int64)  # NCCL's connections for the all-gather set up with every rank present
    comm.all_gather(x.data.ptr + 8 * RANK, x.data.ptr, 1, "int64", s.ptr)
    s.synchronize()
    barrier(cp, comm, s)
    if RANK != 0:
        time.sleep(15)  # never makes the buffer
        comm.abort()
        log("peer gone")
        return False
    b = C.c_void_p(1234)
    t0 = time.monotonic()
    st = lib.moe_rt_peer_buffer_create(ctx, comm.handle, 4096, 1, 0, WORLD, s.ptr, 2000, C.byref(b))
    dt = time.monotonic() - t0
    msg = lib.moe_rt_last_error().decode()
    assert st == TIMEOUT, (st, msg)
    assert 1.9 <= dt < 12, dt
    assert "moe_rt_peer_buffer_create" in msg and "2000 ms" in msg and "communicator was aborted" in msg, msg
    assert b.value is None
    v = C.c_int(-1)
    ok(lib, lib.moe_rt_comm_aborted(comm.handle, C.byref(v)))
    assert v.value == 1
    assert comm.release_if_aborted() is True and comm.closed
    log(f"TIMEOUT OK ({dt:.1f} s)")
    return False


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "exchange"
    cp, comm, lib, ctx = setup()
    keep = {"exchange": exchange, "timeout": timeout}[what](cp, comm, lib, ctx)
    lib.moe_rt_context_destroy(ctx)
    if keep is not False:
        cp.cuda.Device().synchronize()
        comm.close()
        log("ALL OK")


if __name__ == "__main__":
    main()
