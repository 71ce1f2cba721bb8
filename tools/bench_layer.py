"""Entry point of the layer benchmark (the code: moe_rt/bench/layer.py; also `python -m moe_rt bench layer`).

    python tools/bench_layer.py --help
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.bench.layer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
