"""Lets PyPI's torchvision (a CUDA build) import beside the CPU torch of the SGLang CPU install.

torchvision's compiled ops (`_C.so`) link against libtorch_cuda, so with a CPU torch they fail to
load, which torchvision tolerates; but `torchvision/_meta_registrations.py` then registers fake
kernels for `torchvision::nms` and `torchvision::qnms` with `torch.library.register_fake`, which
raises "operator torchvision::nms does not exist" and aborts `import torchvision` (and so
`transformers.image_utils` and SGLang). Defining the two op schemas first makes that import
succeed. The ops still have no kernel: `torchvision.ops.nms` raises torchvision's own
"Couldn't load custom C++ ops" error, and nothing in SGLang's text-model path calls them.

Loaded at interpreter start by sglang_cpu_torchvision.pth (site-packages); it only installs an
import hook, so torch is imported (and the schemas defined) only when torchvision is imported.
Installed by scripts/install_sglang_cpu.sh.
"""

import importlib.abc
import sys

_libs = []  # a torch.library.Library must stay alive for its definitions to stay registered


class _DefineTorchvisionOpSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)  # once is enough, and never again for submodules
            _define_schemas()
        return None  # let the normal finders import torchvision itself


def _define_schemas():
    import torch

    if torch.version.cuda is not None:  # a CUDA torch loads torchvision's real ops: leave it alone
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _libs.append(lib)


sys.meta_path.insert(0, _DefineTorchvisionOpSchemas())
