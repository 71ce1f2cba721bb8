"""Register budgets of the hot kernels' main builds: each compiles (offline, sm_90, NVRTC, one program a
kernel) to registers that keep its resident blocks per multiprocessor. A run-time switch that a template
argument should carry (ep_ll_combine's PARTIALS, aux_loss_bwd's DEV_TOTAL) or a tighter ``__launch_bounds__``
shows up here as fewer blocks.

The test asserts the blocks, not the register count, so a compiler change that keeps the occupancy passes.
The counts were measured with one NVRTC version (NVRTC_VERSION); another version skips the test unless
MOE_RT_TEST_REGISTER_BUDGETS=1."""
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

import moe_rt  # noqa: F401 - imports every op module, which registers its kernels
from moe_rt import _jit
from test_kernels_compile import _nvrtc_available

pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC or CUDA headers not installed")

NVRTC_VERSION = (13, 5)
ARCH = "sm_90"
# sm_90: 65536 registers in 4 sub-partitions, allocated per warp in units of 256 (a thread's count rounded up
# to a multiple of 8); at most 64 warps and 32 blocks a multiprocessor
SM_REGS, SUB_PARTITIONS, REG_UNIT, SM_WARPS, SM_BLOCKS = 65536, 4, 256, 64, 32

# (file, name, threads a block, registers measured with NVRTC_VERSION, resident blocks they give). threads: the
# kernel's __launch_bounds__ where it has one (the test checks it against the cubin), else the block the C
# core launches at the BENCHMARKS.md shapes (E=256 K=8; H=7168 bf16: 224 threads a row).
BUDGETS = [
    ("ep.cu", "ep_ll_combine_pairwise<__nv_bfloat16, true, false>", 512, 64, 2),  # the default sync
    ("ep.cu", "ep_ll_dispatch_pairwise<__nv_bfloat16, int, true>", 512, 94, 1),
    ("ep.cu", "ep_ll_combine<__nv_bfloat16, true, false>", 512, 64, 2),  # MOE_RT_LL_SYNC=barrier
    ("ep.cu", "ep_ll_dispatch<__nv_bfloat16, int, true>", 512, 90, 1),
    ("router.cu", "aux_loss_bwd<float, false>", 256, 40, 6),
    ("router.cu", "aux_loss_bwd<__nv_bfloat16, false>", 256, 40, 6),
    ("router.cu", "router_fwd_reg<__nv_bfloat16, 8, false>", 128, 64, 8),
    ("router.cu", "router_fwd_reg<float, 8, true, true>", 128, 72, 7),
    ("router.cu", "router_fwd_reg<float, 4, false, false, false, -1, 16>", 128, 64, 8),  # short rows: segments
    ("router.cu", "router_fwd_reg<__nv_bfloat16, 8, false, false, false, -1, 8>", 128, 64, 8),
    ("router.cu", "router_bwd_sel<float, 32>", 128, 32, 16),
    ("router.cu", "router_bwd_sel<__nv_bfloat16, 32>", 128, 30, 16),
    ("router.cu", "router_fwd_qb_reg<float, 8>", 640, 92, 1),
    ("permutation.cu", "dispatch_rows<uint4, 4, true>", 224, 40, 6),
    ("permutation.cu", "combine_slices<__nv_bfloat16, true, 1, 8, 1, 128, 8>", 128, 64, 8),
    ("permutation.cu", "combine_bwd_rows<__nv_bfloat16, true, 4>", 224, 56, 5),
]


def blocks_per_sm(regs: int, threads: int) -> int:
    """Resident blocks of ``threads`` threads at ``regs`` registers a thread (the occupancy calculator's
    register and thread limits; shared memory left out)."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = (SM_REGS // SUB_PARTITIONS // per_warp) * SUB_PARTITIONS // warps
    return min(by_regs, SM_WARPS // warps, SM_BLOCKS)


def cubin_kernels(img: bytes) -> dict:
    """{lowered name: (registers, launch-bound threads or None)} from a cubin's .nv.info sections
    (EIATTR_REGCOUNT 0x2f in .nv.info, EIATTR_MAX_THREADS 0x05 in .nv.info.<name>)."""
    shoff, = struct.unpack_from("<Q", img, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", img, 0x3A)
    secs = [struct.unpack_from("<IIQQQQII", img, shoff + i * shentsize) for i in range(shnum)]

    def cstr(off):
        return img[off:img.index(b"\0", off)].decode()

    names = [cstr(secs[shstrndx][4] + s[0]) for s in secs]
    syms = {}
    for s in secs:
        if s[1] == 2:  # SHT_SYMTAB
            syms = {j: cstr(secs[s[6]][4] + struct.unpack_from("<I", img, s[4] + 24 * j)[0])
                    for j in range(s[5] // 24)}
    regs, threads = {}, {}
    for name, s in zip(names, secs):
        if not name.startswith(".nv.info"):
            continue
        p, end = s[4], s[4] + s[5]
        while p < end:
            fmt, attr = img[p], img[p + 1]
            if fmt != 4:  # no value (1), or a 2-byte value (2, 3)
                p += 2 if fmt == 1 else 4
                continue
            size, = struct.unpack_from("<H", img, p + 2)
            if attr == 0x2F:
                f, r = struct.unpack_from("<II", img, p + 4)
                regs[syms[f]] = r
            elif attr == 0x05:
                threads[name[len(".nv.info."):]] = struct.unpack_from("<III", img, p + 4)[0]
            p += 4 + size
    return {k: (r, threads.get(k)) for k, r in regs.items()}


@pytest.fixture(scope="module")
def measured():
    from cupy.cuda import nvrtc

    version = tuple(nvrtc.getVersion())
    if version != NVRTC_VERSION and os.environ.get("MOE_RT_TEST_REGISTER_BUDGETS") != "1":
        pytest.skip(f"register budgets measured with NVRTC {NVRTC_VERSION}, this is {version} (set "
                    "MOE_RT_TEST_REGISTER_BUDGETS=1 to check them anyway)")

    def one(row):
        img, lowered = _jit.compile_offline(row[0], ARCH, [row[1]])
        return cubin_kernels(bytes(img))[lowered[row[1]]]

    with ThreadPoolExecutor(os.cpu_count() or 1) as ex:  # NVRTC compiles without the GIL
        return dict(zip((r[1] for r in BUDGETS), ex.map(one, BUDGETS)))


def test_blocks_per_sm_matches_the_occupancy_calculator():
    assert blocks_per_sm(63, 512) == blocks_per_sm(64, 512) == 2 and blocks_per_sm(65, 512) == 1
    assert blocks_per_sm(40, 256) == 6 and blocks_per_sm(47, 256) == 5
    assert blocks_per_sm(32, 128) == 16 and blocks_per_sm(16, 32) == 32 and blocks_per_sm(255, 1024) == 0


@pytest.mark.parametrize("file,name,threads,regs,blocks", BUDGETS, ids=[r[1] for r in BUDGETS])
def test_registers_keep_resident_blocks(measured, file, name, threads, regs, blocks):
    assert blocks_per_sm(regs, threads) == blocks, "the table's registers and blocks disagree"
    got, bound = measured[name]
    assert bound in (None, threads), f"{name}: __launch_bounds__ {bound} threads, the table says {threads}"
    assert blocks_per_sm(got, threads) >= blocks, (
        f"{name}: {got} registers a thread give {blocks_per_sm(got, threads)} resident {threads}-thread blocks "
        f"per SM on {ARCH}, {blocks} with the {regs} measured before")
