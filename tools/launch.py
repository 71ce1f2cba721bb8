#!/usr/bin/env python3
"""Run N local copies of a Python script, one per GPU (the code: moe_rt/launch.py).

    python tools/launch.py -n 2 script.py [args...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
