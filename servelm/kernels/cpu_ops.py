"""The fused element-wise layers of `cpu_ops.c`, called on CPU tensors.

    ops = CpuOps.load()                       # None: no C compiler here, use torch
    normed, x = ops.add_rms_norm(x, delta, weight, eps)
    ops.rotary_(qk, cos, signed_sin)          # in place
    h = ops.silu_and_mul(gate_up)
    tokens = ops.argmax(logits)               # each row's largest value's index (float32)

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


def _fits(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A contiguous CPU tensor of `dtype`. These checks run ~100 times a step, hence plain."""
    return t.dtype == dtype and t.is_cpu and t.is_contiguous()


class CpuOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        # (op name) -> {dtype: C function}
        self.fns: dict[str, dict[torch.dtype, ctypes._CFuncPtr]] = {}
        for name, argtypes in _SIGNATURES.items():
            self.fns[name] = {}
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self.fns[name][dtype] = fn
        self._norm, self._rotary, self._silu = (
            self.fns[n] for n in ("add_rms_norm", "rotary", "silu_and_mul")
        )
        self._argmax = lib.argmax_rows_f32
        self._argmax.argtypes, self._argmax.restype = [_ptr, _i64, _i64, _ptr], None

    @classmethod
    def load(cls, extra_flags: tuple[str, ...] = ()) -> CpuOps | None:
        """None where there is no C compiler. `extra_flags`: for the compiler (tests build
        other CPUs' paths this way: `variants.py`)."""
        lib = load_library(SOURCE, extra_flags)
        return None if lib is None else cls(lib)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(x + delta) * weight, x + delta) for x [T, H]; x is updated in place."""
        fn = self._norm.get(x.dtype)
        if fn is None or x.dim() != 2 or not (_fits(x, x.dtype) and _fits(weight, x.dtype)):
            return None
        if weight.shape != x.shape[1:] or (
            delta is not None and (delta.shape != x.shape or not _fits(delta, x.dtype))
        ):
            return None
        out = torch.empty_like(x)
        T, H = x.shape
        fn(x.data_ptr(), delta.data_ptr() if delta is not None else None, weight.data_ptr(),
           out.data_ptr(), T, H, eps)  # fmt: skip
        return out, x

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
        """Rotates x [T, H, D] in place (rows may be strided, heads side by side); cos and
        signed_sin [T, 1, D] from `RotaryEmbedding.lookup`. False when it did nothing."""
        fn = self._rotary.get(x.dtype)
        T, H, D = x.shape
        if fn is None or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != D:
            return False
        if not (_fits(cos, x.dtype) and _fits(signed_sin, x.dtype)):
            return False
        if cos.numel() != T * D or signed_sin.numel() != T * D:
            return False
        fn(x.data_ptr(), x.stride(0), T, H, D, cos.data_ptr(), signed_sin.data_ptr())
        return True

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for gate_up [T, 2I] holding gate and up side by side."""
        fn = self._silu.get(gate_up.dtype)
        if fn is None or gate_up.dim() != 2 or not _fits(gate_up, gate_up.dtype):
            return None
        T, two_i = gate_up.shape
        out = gate_up.new_empty((T, two_i // 2))
        fn(gate_up.data_ptr(), out.data_ptr(), T, two_i // 2)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x.max(dim=-1).indices for float32 x [B, V]: the first largest value's index in each
        row (the first NaN's, where a row has one)."""
        if x.dim() != 2 or not _fits(x, torch.float32) or x.shape[1] == 0:
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out
