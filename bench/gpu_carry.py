"""What travels to the lent GPU machine beside the working tree (at most 64 MiB a call), into .gpu-carry/ (ignored):

    .venv/bin/python bench/gpu_carry.py                 # on a CPU machine with PyPI; then carry .gpu-carry
    .venv/bin/python bench/gpu_carry.py --python 3.11 --dest /tmp/carry311   # for another Python (GPU_CARRY=...)

- wheels/: exactly the wheels of bench/gpu_wheels.txt (for CPython 3.12 on x86_64 Linux, the GPU machine's), no
  dependencies resolved; what was there and is no longer listed is removed.
- cache/: the tiny default model (data.tiny.default_model, built here if missing), so the main job does not spend
  minutes of GPU time warming it up on the GPU machine's CPU. Its folder name is the same on any machine.
Prints each file's size and the total, and exits 1 above LIMIT_MIB (well under the 64 MiB limit: the working tree
travels in the same call). bench/gpu_check.sh installs and copies these on the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
LIMIT_MIB = 40
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")


def pins(path: str = os.path.join(REPO, "bench", "gpu_wheels.txt")) -> list[str]:
    """The name==version lines of gpu_wheels.txt, comments dropped."""
    with open(path) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return [line for line in lines if line]


def wheel_name(pin: str) -> str:
    """A pin's distribution name as wheel file names spell it (PEP 427: runs of -_. become _), lower-cased."""
    name, _ = pin.split("==")
    return "".join("_" if c in "-." else c for c in name).lower()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python version (its image: 3.12)")
    ap.add_argument(
        "--dest", default=os.path.join(REPO, ".gpu-carry"), help="the folder (bench/gpu_check.sh: $GPU_CARRY)"
    )
    args = ap.parse_args()
    carry = args.dest
    wheels = os.path.join(carry, "wheels")
    os.makedirs(wheels, exist_ok=True)
    want = pins()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        args.python,
    ]
    cmd += [arg for p in PLATFORMS for arg in ("--platform", p)] + ["-d", wheels, *want]
    subprocess.run(cmd, check=True)
    names = {wheel_name(p) for p in want}
    for f in os.listdir(wheels):
        if f.split("-")[0].lower() not in names:
            os.remove(os.path.join(wheels, f))
    from data.tiny import default_model

    model = default_model(os.path.join(REPO, ".cache"))
    cache = os.path.join(carry, "cache", os.path.basename(model))
    shutil.rmtree(os.path.join(carry, "cache"), ignore_errors=True)
    shutil.copytree(model, cache)
    total = 0
    for root, _, files in sorted(os.walk(carry)):
        for f in sorted(files):
            size = os.path.getsize(os.path.join(root, f))
            total += size
            print(f"{size / 2**20:8.2f} MiB  {os.path.relpath(os.path.join(root, f), carry)}")
    print(f"{total / 2**20:8.2f} MiB  in all ({len(os.listdir(wheels))} wheels for {len(want)} pins)")
    if len(os.listdir(wheels)) != len(want):
        sys.exit(f"gpu_carry: {len(os.listdir(wheels))} wheels for {len(want)} pins in bench/gpu_wheels.txt")
    if total > LIMIT_MIB * 2**20:
        sys.exit(f"gpu_carry: {total / 2**20:.1f} MiB is over the {LIMIT_MIB} MiB this script allows")


if __name__ == "__main__":
    main()
