"""The fused element-wise layers of `cpu_ops.c`, called on CPU tensors.

    ops = CpuOps.load()                       # None: no C compiler here, use torch
    normed, x = ops.add_rms_norm(x, delta, weight, eps)
    ops.rotary_(qk, cos, signed_sin)          # in place
    h = ops.silu_and_mul(gate_up)

Each returns None for a tensor it does not take (another device or dtype, or an unusual
layout), and the caller runs its torch ops instead: the layers stay correct on every device and
the C code stays small.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from servelm.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_ops.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float],
    "rotary": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr],
    "silu_and_mul": [_ptr, _ptr, _i64, _i64],
}


def _takes(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return first.dtype in _SUFFIX and all(
        t.device.type == "cpu" and t.dtype == first.dtype for t in tensors
    )


class CpuOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fns = {}
        for name, argtypes in _SIGNATURES.items():
            for suffix in _SUFFIX.values():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self.fns[name, suffix] = fn

    @classmethod
    def load(cls) -> CpuOps | None:
        lib = load_library(SOURCE)
        return None if lib is None else cls(lib)

    def _fn(self, name: str, dtype: torch.dtype):
        return self.fns[name, _SUFFIX[dtype]]

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(x + delta) * weight, x + delta) for x [T, H]; x is updated in place."""
        inputs = (x, weight) if delta is None else (x, weight, delta)
        if x.dim() != 2 or not _takes(*inputs) or not all(t.is_contiguous() for t in inputs):
            return None
        out = torch.empty_like(x)
        self._fn("add_rms_norm", x.dtype)(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
        )
        return out, x

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
        """Rotates x [T, H, D] in place (rows may be strided, heads side by side); cos and
        signed_sin [T, 1, D] from `RotaryEmbedding.lookup`. False when it did nothing."""
        T, H, D = x.shape
        tables_ok = all(t.is_contiguous() and t.numel() == T * D for t in (cos, signed_sin))
        if not (_takes(x, cos, signed_sin) and tables_ok and x.stride(2) == 1 and x.stride(1) == D):
            return False
        self._fn("rotary", x.dtype)(
            x.data_ptr(), x.stride(0), T, H, D, cos.data_ptr(), signed_sin.data_ptr()
        )
        return True

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for gate_up [T, 2I] holding gate and up side by side."""
        if gate_up.dim() != 2 or not _takes(gate_up) or not gate_up.is_contiguous():
            return None
        T, two_i = gate_up.shape
        out = gate_up.new_empty((T, two_i // 2))
        self._fn("silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), T, two_i // 2)
        return out
