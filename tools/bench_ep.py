"""Entry point of the expert-parallel benchmark on 2 local GPUs (the code: moe_rt/bench/ep.py; also
``python -m moe_rt bench ep``). It launches itself on the GPUs (moe_rt.bench.launch).

    python tools/bench_ep.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.bench.ep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
