"""Entry point of the FP8 quantize benchmark (the code: moe_rt/bench/fp8.py; also `python -m moe_rt bench fp8`).

    python tools/bench_fp8.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.bench.fp8 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
