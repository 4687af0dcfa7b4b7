"""Placeholder for `sgl_kernel` (SGLang's compiled kernels). It contains no kernels.

SGLang imports `sgl_kernel` unconditionally, but the CPU build of sgl-kernel is not on PyPI
(PyPI's `sglang-kernel` is CUDA-only and needs libcuda.so.1 at import). On a processor where
SGLang does not take its Intel AMX backend, its CPU mode runs pure-torch code and calls none of
these ops. SGLang decides that with `hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`
(sglang/srt/utils/common.py, `_is_intel_amx_backend_available`), which is False here because this
package registers no ops, so SGLang keeps the pure-torch paths on every processor.

Any attribute looked up here is a function that raises, so a code path that does need a real
kernel fails loudly instead of computing something wrong. Installed by
scripts/install_sglang_cpu.sh.
"""

PLACEHOLDER = True


def __getattr__(name: str):
    if name.startswith("__"):  # keep Python's own protocol look-ups (e.g. __path__) honest
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel placeholder: sgl_kernel.{name} was called, but the CPU build of "
            "sgl-kernel is not on PyPI, so this install has no SGLang kernels "
            "(see scripts/install_sglang_cpu.sh)"
        )

    missing.__name__ = name
    return missing
