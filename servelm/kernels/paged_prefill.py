"""The CPU prefill attention of `paged_prefill.c` (AMX tiles, AVX-512 BF16, or float32 in AVX-512
or AVX2), called on torch tensors.

    kernel = PagedPrefillKernel.load(torch.bfloat16, head_dim=64, block_size=16)  # None: SDPA
    kernel(q, k_cache, v_cache, blocks, block_size, context_len, scale, out,
           window=None, softcap=None)

q [n, Hq, D]: the n newest tokens of one sequence (rows may be strided views into a fused
projection output), already stored in the caches [num_slots, Hkv, D] with the rest of its
context; blocks: its block table (int64); out [n, Hq, D], written in place (a row view of the
step's output is fine). Query i sits at position context_len - n + i and sees keys up to it,
or with a `window` W only the last W of them (position - W < key); `softcap` c turns each scaled
score s into c tanh(s / c) (None: off).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from servelm.kernels import variants
from servelm.kernels.build import load_library
from servelm.kernels.paged_decode import rows_of_heads

SOURCE = Path(__file__).with_name("paged_prefill.c")

# q, q_stride, k_cache, v_cache, blocks, block_size, n, ctx, Hq, Hkv, D, scale, out,
# out_stride, scratch
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr] + [_i64] * 6 + [ctypes.c_float, _ptr, _i64, _ptr]
# paged_prefill_bf16_win: ... scale, window, softcap, out, out_stride, scratch (0: off)
_ARGTYPES_WIN = [*_ARGTYPES[:12], _i64, ctypes.c_float, *_ARGTYPES[12:]]


PATHS = {1: "AMX", 2: "AVX2", 3: "AVX-512 BF16", 4: "AVX-512"}  # paged_prefill_available()


class PagedPrefillKernel:
    def __init__(self, lib: ctypes.CDLL, head_dim: int, path: int) -> None:
        self.name = f"paged_prefill_bf16 ({PATHS[path]})"
        self.fn = lib.paged_prefill_bf16  # full attention (the C layer loop calls it)
        self.fn.argtypes, self.fn.restype = _ARGTYPES, None
        self.fn_win = lib.paged_prefill_bf16_win  # with a window and soft-capping
        self.fn_win.argtypes, self.fn_win.restype = _ARGTYPES_WIN, None
        self.fn_many = lib.paged_prefill_bf16_many  # many chunks at once (the C layer loop)
        self.scratch_bytes = lib.paged_prefill_scratch_bytes
        self.scratch_bytes.argtypes, self.scratch_bytes.restype = [_i64] * 3, _i64
        self.head_dim = head_dim
        self._scratch = torch.empty(0, dtype=torch.uint8)  # V^T packed, grown as needed

    @classmethod
    def load(
        cls,
        dtype: torch.dtype,
        head_dim: int,
        block_size: int,
        extra_flags: tuple[str, ...] | None = None,
    ) -> PagedPrefillKernel | None:
        """The kernel, or None where there is none: not bfloat16, a head size that is not a
        multiple of 32 up to 256, blocks not a multiple of 16 tokens, no C compiler, or a CPU
        (or kernel) with neither AMX tiles nor AVX2. `extra_flags`: for the compiler (tests
        build each variant this way); None: this CPU's build, or where that has no path (an
        AMX CPU refused its tiles) another's (`variants.prefill_fallback`)."""
        if dtype != torch.bfloat16 or head_dim % 32 or head_dim > 256 or block_size % 16:
            return None
        if extra_flags is None:
            extra_flags = variants.prefill_fallback() or ()
        lib = load_library(SOURCE, extra_flags)
        if lib is None:
            return None
        lib.paged_prefill_available.restype = _i64
        path = lib.paged_prefill_available()
        return cls(lib, head_dim, path) if path else None

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        context_len: int,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        q = rows_of_heads(q)
        if q.stride(0) % 2:  # the kernel reads q's rows as 32-bit words
            q = q.contiguous()
        n, num_heads, d = q.shape
        num_kv_heads = k_cache.shape[1]
        if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16):
            raise ValueError("this kernel is for bfloat16 tensors")
        if (
            d != self.head_dim
            or k_cache.shape != v_cache.shape
            or k_cache.shape[2] != d
            or num_heads % num_kv_heads
            or out.shape != q.shape
            or not 0 < n <= context_len
            or blocks.numel() * block_size < context_len
        ):
            raise ValueError("q, caches, blocks, out or context length: shapes disagree")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and blocks.is_contiguous()):
            raise ValueError("caches and the block table must be contiguous")
        if blocks.dtype != torch.int64 or out.stride(2) != 1 or out.stride(1) != d:
            raise ValueError("blocks must be int64 and out's heads side by side")
        scratch = self.scratch(context_len, num_kv_heads, d)
        self.fn_win(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            blocks.data_ptr(),
            block_size,
            n,
            context_len,
            num_heads,
            num_kv_heads,
            d,
            scale,
            window or 0,
            softcap or 0.0,
            out.data_ptr(),
            out.stride(0),
            scratch,
        )
        return out

    def scratch(self, context_len: int, num_kv_heads: int, head_dim: int) -> int:
        """The address of a scratch buffer for a call over `context_len` tokens; it grows by
        doubling and is reused."""
        need = self.scratch_bytes(context_len, num_kv_heads, head_dim)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()), dtype=torch.uint8)
        return self._scratch.data_ptr()
