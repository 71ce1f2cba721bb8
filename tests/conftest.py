"""Shared test configuration: GPU detection, markers, seeded random generators."""
import os

import numpy as np
import pytest

# JAX grabs 75% of GPU memory on first use by default; in one test process beside torch and CuPy it must
# allocate on demand instead, or memory-hungry tests later in the run find the device full.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPU_COUNT = _gpu_count()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multi_gpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and GPU_COUNT < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng(request):
    """A generator seeded from the test id, fresh per test; MOE_RT_TEST_SEED shifts every seed."""
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("MOE_RT_TEST_SEED", "0"))
    return np.random.default_rng(seed)
