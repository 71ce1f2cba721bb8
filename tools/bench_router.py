"""Entry point of the router benchmark (the code: moe_rt/bench/router.py; also `python -m moe_rt bench router`).

    python tools/bench_router.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.bench.router import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
