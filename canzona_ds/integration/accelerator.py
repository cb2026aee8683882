"""What DeepSpeed's accelerator can do here, asked rather than assumed.

DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX CPUs); on other x86
CPUs ``deepspeed.initialize`` refuses ``"fp16": {"enabled": true}``.  The fp16 *logic* we
test (dynamic loss scaling, overflow skips, unscaling into the fp32 master) does not need
fp16 arithmetic hardware: :func:`allow_fp16` lets the tests tell the CPU accelerator that
fp16 is allowed, so the fp16 path is tested on every machine.
"""
from __future__ import annotations

import contextlib


def fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@contextlib.contextmanager
def allow_fp16():
    """Within the block, DeepSpeed's CPU accelerator reports fp16 as supported."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accel = get_accelerator()
    if not isinstance(accel, CPU_Accelerator) or accel.is_fp16_supported():
        yield
        return
    cls = type(accel)
    saved_fp16, saved_dtypes = cls.is_fp16_supported, cls.supported_dtypes
    cls.is_fp16_supported = lambda self: True
    cls.supported_dtypes = lambda self: saved_dtypes(self) + ([] if _has_fp16(saved_dtypes(self)) else [_fp16()])
    try:
        yield
    finally:
        cls.is_fp16_supported, cls.supported_dtypes = saved_fp16, saved_dtypes


def _fp16():
    import torch

    return torch.float16


def _has_fp16(dtypes) -> bool:
    return _fp16() in dtypes
