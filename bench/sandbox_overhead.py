"""The python tool's cost per call on a trivial program, sandboxed (bwrap, a cgroup) and unsandboxed (a plain
subprocess of the trainer's interpreter), and the base interpreter the sandbox runs, started as a plain subprocess: the
sandbox's own share is the last two apart (the base interpreter can start slower than a venv's: its site-packages and
.pth files). The median and spread of --calls calls each, after one warm-up call.

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

import sandbox  # noqa: E402
from tools import PythonLimits, python  # noqa: E402


def timed(call, calls: int) -> list[float]:
    """Seconds per call of call(), after one warm-up call."""
    call()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50, help="timed calls per mode")
    p.add_argument("--code", default="pass", help="the program each call runs")
    args = p.parse_args()
    print(f"python tool, {args.calls} calls of {args.code!r} (ms per call: median, min, max)")
    argv, _ = sandbox.interpreter()
    base = PythonLimits()
    modes = {
        "unsandboxed": lambda: python(args.code, PythonLimits(unsandboxed=True)),
        "base interpreter, no sandbox": lambda: sandbox.run(
            [*argv, "-c", args.code], {}, base, keep_bytes=8016, sandboxed=False
        ),
        "sandboxed": lambda: python(args.code, base),
    }
    rows = {}
    for name, call in modes.items():
        t = [1000 * s for s in timed(call, args.calls)]
        rows[name] = statistics.median(t)
        print(f"  {name:<30} {statistics.median(t):7.1f} {min(t):7.1f} {max(t):7.1f}")
    print(
        f"  the sandbox adds {rows['sandboxed'] - rows['unsandboxed']:.1f} ms per call to the unsandboxed tool (median),"
    )
    print(
        f"  {rows['sandboxed'] - rows['base interpreter, no sandbox']:.1f} ms to the same interpreter started without it"
    )


if __name__ == "__main__":
    main()
