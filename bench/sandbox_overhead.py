"""The python tool's cost per call on a trivial program, sandboxed (bwrap, a cgroup) and unsandboxed (a plain
subprocess): what the sandbox adds to a tool call. Prints both, with the median and spread of --calls calls each after
one warm-up call.

    .venv/bin/python bench/sandbox_overhead.py              # 50 calls of each
    .venv/bin/python bench/sandbox_overhead.py --calls 200 --code "import json; print(json.dumps([1, 2]))"
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import PythonLimits, python  # noqa: E402


def timed(code: str, limits: PythonLimits, calls: int) -> list[float]:
    """Seconds per call of python(code, limits), after one warm-up call."""
    python(code, limits)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        python(code, limits)
        times.append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50, help="timed calls per mode")
    p.add_argument("--code", default="pass", help="the program each call runs")
    args = p.parse_args()
    print(f"python tool, {args.calls} calls of {args.code!r} (ms per call: median, min, max)")
    rows = {}
    for name, limits in (("unsandboxed", PythonLimits(unsandboxed=True)), ("sandboxed", PythonLimits())):
        t = [1000 * s for s in timed(args.code, limits, args.calls)]
        rows[name] = statistics.median(t)
        print(f"  {name:<12} {statistics.median(t):7.1f} {min(t):7.1f} {max(t):7.1f}")
    print(f"  the sandbox adds {rows['sandboxed'] - rows['unsandboxed']:.1f} ms per call (median)")


if __name__ == "__main__":
    main()
