"""The CPU decode attention of `paged_decode.c`, called on torch tensors.

    kernel = PagedDecodeKernel.load(torch.bfloat16, head_dim=64)   # None: use the torch path
    out = kernel(q, k, v, k_cache, v_cache, slots, block_tables, block_size, context_lens,
                 max_len, scale, window=None, softcap=None)

q [B, Hq, D], k/v [B, Hkv, D] (rows may be strided views into a fused projection output);
caches [num_slots, Hkv, D]; block_tables [B, max_blocks] int64; context_lens [B] int64, each
counting the new token. `slots` [B] int64 stores k/v in the caches first; with None the caller
has stored them already (k and v may then be None). `window`: attend to the last `window`
positions only (None: all); `softcap`: scores -> softcap * tanh(scores / softcap) (None: off).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from servelm.kernels.build import load_library

SOURCE = Path(__file__).with_name("paged_decode.c")
_TYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_HEAD_DIMS = (16, 32, 64, 128)  # the sizes paged_decode.c exports

# The exported functions' signature: q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache,
# slots, block_tables, max_blocks, context_lens, B, Hq, Hkv, block_size, max_len, scale, out.
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
_ARGTYPES += [_i64] * 5 + [ctypes.c_float, _ptr]
# The `_win` exports: ... scale, window, softcap, out (0: off).
_ARGTYPES_WIN = [*_ARGTYPES[:-1], _i64, ctypes.c_float, _ptr]


class PagedDecodeKernel:
    def __init__(
        self, fn: ctypes._CFuncPtr, fn_win: ctypes._CFuncPtr, dtype: torch.dtype, head_dim: int
    ) -> None:
        self.fn = fn  # full attention (the C layer loop calls it)
        self.fn_win = fn_win  # with a window and soft-capping
        self.name = fn.__name__
        self.dtype = dtype
        self.head_dim = head_dim

    @classmethod
    def load(
        cls, dtype: torch.dtype, head_dim: int, extra_flags: tuple[str, ...] = ()
    ) -> PagedDecodeKernel | None:
        """The kernel for this cache dtype and head size, or None where there is none (other
        dtypes or head sizes, or no C compiler on this machine). Its name says "(AVX2)" where
        bfloat16 caches take the vector path (CPUs with AVX2 and without AVX-512; models with
        more than 8 query heads per KV head still take the generic loops). `extra_flags`: for
        the compiler (tests build it without AVX2 this way)."""
        if dtype not in _TYPES or head_dim not in _HEAD_DIMS:
            return None
        lib = load_library(SOURCE, extra_flags)
        if lib is None:
            return None
        fn = getattr(lib, f"paged_decode_{_TYPES[dtype]}_d{head_dim}")
        fn.argtypes, fn.restype = _ARGTYPES, None
        fn_win = getattr(lib, f"paged_decode_{_TYPES[dtype]}_d{head_dim}_win")
        fn_win.argtypes, fn_win.restype = _ARGTYPES_WIN, None
        kernel = cls(fn, fn_win, dtype, head_dim)
        lib.paged_decode_vector_path.argtypes, lib.paged_decode_vector_path.restype = (
            [_i64] * 2,
            _i64,
        )
        if lib.paged_decode_vector_path(dtype == torch.bfloat16, head_dim):
            kernel.name += " (AVX2)"
        return kernel

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor | None,
        block_tables: torch.Tensor,
        block_size: int,
        context_lens: torch.Tensor,
        max_len: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if slots is None:  # stored already: the new rows are not read
            k = v = q.new_empty((0, 0, 0))
        q, k, v = rows_of_heads(q), rows_of_heads(k), rows_of_heads(v)
        dtype = self.dtype
        if not (q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == dtype):
            raise ValueError(f"this kernel is for {dtype} tensors")
        if not (block_tables.dtype == context_lens.dtype == torch.int64) or not (
            slots is None or slots.dtype == torch.int64
        ):
            raise ValueError("block tables, context lengths and slots must be int64")
        (batch, num_heads, d), heads = q.shape, k_cache.shape[1:]  # heads: (Hkv, D)
        rows = [block_tables.shape[0], context_lens.shape[0]]
        new_kv_ok = slots is None or (k.shape[1:] == v.shape[1:] == heads)
        rows += [] if slots is None else [slots.shape[0], k.shape[0], v.shape[0]]
        if (
            min(rows) < batch
            or d != self.head_dim
            or k_cache.shape != v_cache.shape
            or heads[1] != d
            or num_heads % heads[0]
            or not new_kv_ok
        ):
            raise ValueError("q, k/v, caches, slots, block tables or lengths: shapes disagree")
        contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
        contiguous &= block_tables.is_contiguous() and context_lens.is_contiguous()
        if not contiguous or not (slots is None or slots.is_contiguous()):
            raise ValueError("caches, block tables, context lengths and slots must be contiguous")
        out = torch.empty((batch, num_heads, self.head_dim), dtype=self.dtype)
        self.fn_win(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            None if slots is None else slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            batch,
            num_heads,
            k_cache.shape[1],
            block_size,
            max_len,
            scale,
            window or 0,
            softcap or 0.0,
            out.data_ptr(),
        )
        return out


def rows_of_heads(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, D] whose heads lie side by side in each row (a row may be a strided view)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()
