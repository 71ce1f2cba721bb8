"""Entry point of the permutation benchmark (the code: moe_rt/bench/permutation.py; also `python -m moe_rt bench permutation`).

    python tools/bench_permutation.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.bench.permutation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
