"""Run torchao's blockwise fp8 quantize kernels under ``TRITON_INTERPRET=1`` and compare them with the reference.

Used by ``tests/ops/test_fp8.py`` in a fresh process (the variable is read when triton is imported). Exits non-zero
on the first difference; prints one ``bitwise equal`` line per kernel.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

from xtl.ops.fp8 import quantize_1x128, quantize_128x128

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
_convert_float = interpreter._convert_float


def _rne_convert_float(data, input_dtype, output_dtype, rounding_mode):  # noqa: ANN001, ANN202
    """The interpreter's cast, except float32 -> e4m3 which goes through torch (round to nearest even, saturated
    values already clamped by the kernels), as the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` does."""
    if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
        as_fp8 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.float8_e4m3fn)
        return as_fp8.view(torch.uint8).numpy()
    return _convert_float(data, input_dtype, output_dtype, rounding_mode)


interpreter._convert_float = _rne_convert_float

from torchao.prototype.blockwise_fp8_training import kernels  # noqa: E402 - after the cast is patched

for kernel in (
    kernels.triton_fp8_blockwise_act_quant_lhs_kernel,
    kernels.triton_fp8_blockwise_act_quant_rhs_kernel,
    kernels.triton_fp8_blockwise_weight_quant_rhs_kernel,
):  # one config each, the one with the fewest programs: the interpreter cannot benchmark configs
    kernel.configs = [max(kernel.configs, key=lambda c: c.kwargs.get("NUM_GROUPS", 0))]

torch.manual_seed(0)
x = torch.randn(256, 256, dtype=torch.bfloat16)
x[3, :128] *= 1e4  # groups with very different ranges
x[200:, 128:] *= 1e-4
cases = {
    "act_quant_lhs (1x128)": (kernels.triton_fp8_blockwise_act_quant_lhs(x), quantize_1x128(x)),
    "act_quant_rhs (128x1)": (kernels.triton_fp8_blockwise_act_quant_rhs(x), [t.t() for t in quantize_1x128(x.t())]),
    "weight_quant_rhs (128x128)": (kernels.triton_fp8_blockwise_weight_quant_rhs(x), quantize_128x128(x)),
}
for name, ((q, scale_inv), (q_ref, scale_inv_ref)) in cases.items():
    assert q.dtype == q_ref.dtype == torch.float8_e4m3fn, (name, q.dtype)
    assert torch.equal(scale_inv, scale_inv_ref), f"{name}: scales differ"
    differ = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    assert differ == 0, f"{name}: {differ} fp8 values differ"
    print(f"{name}: bitwise equal")
