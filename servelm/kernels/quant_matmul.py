"""Quantized weights times bfloat16 rows, in `quant_matmul.c`: the int4 projections and the head.

    kernel = QuantMatmul.load()                 # None: no C compiler here, use torch
    packed = kernel.pack_q4(q, scale, low)      # once, at load: q [N, K] in 0..15
    y = kernel.q4(x, packed, N)                 # x [B, K] bfloat16 -> y [B, N] bfloat16
    kernel.use_activations("int8")              # x as int16, int8, float32, or "auto"
    kernel.batch_invariant(False)               # pick paths by row count (faster, see the C file)
    packed = kernel.pack_q8(q, scale)           # q [N, K] in -127..127
    y = kernel.q8(x, packed, N)                 # x [B, K] bfloat16 -> y [B, N] float32 (logits)
    packed, error = kernel.quantize_q4(w)       # the same from a float32 weight on the grid
                                                # (error in grid steps; quantize_q8 likewise)
    y = kernel.gguf(x, blocks, qtype, N)        # GGUF Q8_0 / Q4_K / Q5_K / Q6_K blocks as the
                                                # file holds them, blocks [N, row bytes] uint8

Groups of 32 along each row share a float16 scale (and, for q4, a low): GGUF's Q4_1 and Q8_0,
whose values these hold exactly. `pack_*` lay the weight out as the C code reads it: rows in
blocks of 16, one vector lane per row (see the C file).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from servelm.kernels.build import load_library
from servelm.kernels.paths import AMX_MIN_ROWS, INT_X_MIN_ROWS, sgemm_min_rows

SOURCE = Path(__file__).with_name("quant_matmul.c")
GROUP = 32  # weights along a row that share a scale
LANES = 16  # rows per block
Q4_BYTES = LANES * GROUP // 2 + LANES * 2 * 2  # per block and group: quants, scales, lows
Q8_BYTES = LANES * GROUP + LANES * 2  # quants, scales

# how q4 may take x on the C kernel's vector paths: bits of the integers it is quantized to
# (0: as it is); "auto" is the build's own choice (int16 with AVX2 alone or AVX-512 without
# BF16, x as it is with AVX-512 BF16)
ACTIVATIONS = {"int16": 16, "int8": 8, "float32": 0}
AUTO = "auto"

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def _as_bytes(t: torch.Tensor, blocks: int, groups: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(blocks, groups, -1)


def _per_block(values: torch.Tensor) -> torch.Tensor:
    """[N, G] float -> [N / 16, G, 16] float16: a group's values for a block's 16 rows."""
    rows, groups = values.shape
    return values.to(torch.float16).view(rows // LANES, LANES, groups).transpose(1, 2)


class QuantMatmul:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fns = {}
        for kind in ("q4", "q8"):
            fn = getattr(lib, f"{kind}_matmul_bf16")
            fn.argtypes, fn.restype = [_ptr, _ptr, _ptr, _i64, _i64, _i64], None
            self.fns[kind] = fn
        self.silu_fn = lib.q4_silu_matmul_bf16  # the gate/up projection and silu_and_mul at once
        self.silu_fn.argtypes, self.silu_fn.restype = [_ptr, _ptr, _ptr, _i64, _i64, _i64], _i64
        lib.q4_row_cutoffs.argtypes, lib.q4_row_cutoffs.restype = [_i64, _i64], None
        lib.q4_row_cutoffs(AMX_MIN_ROWS, INT_X_MIN_ROWS)  # by row count (paths.py)
        self._tile_min_rows = lib.q4_tile_min_rows
        self._tile_min_rows.restype = ctypes.c_int64
        self._invariant = lib.q4_batch_invariant
        self._invariant.argtypes, self._invariant.restype = [_i64], _i64
        self._dequantize = lib.q4_dequantize_f32
        self._dequantize.argtypes, self._dequantize.restype = [_ptr, _ptr, _i64, _i64], None
        self.quantizers = {}
        for kind in ("q4", "q8"):
            fn = getattr(lib, f"{kind}_quantize_f32")
            fn.argtypes, fn.restype = [_ptr, _ptr, _i64, _i64], ctypes.c_float
            self.quantizers[kind] = fn
        self._activation_bits = lib.q4_activation_bits
        self._activation_bits.argtypes, self._activation_bits.restype = [_i64], _i64
        self.invariant = bool(self._invariant(-1))
        self._set_bits(self._activation_bits(-1))
        self._scratch = torch.empty(0)
        self._gguf = lib.gguf_matmul_bf16
        self._gguf.argtypes = [_i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64]
        self._gguf.restype = None
        self._gguf_dequantize = lib.gguf_dequantize_f32
        self._gguf_dequantize.argtypes = [_i64, _ptr, _ptr, _i64, _i64]
        self._gguf_dequantize.restype = None

    def use_activations(self, kind: str) -> None:
        """How q4 takes x, where this build has integer paths (see the C file): "int16" (exact
        but for x far below its group's largest), "int8" (about 0.7 % off; twice int16's rate
        with VNNI), "float32" (x as it is: float32 FMAs, or bfloat16 pairs with AVX-512 BF16),
        or "auto", the build's own choice: int16 where that is faster than x as it is (AVX2
        alone, AVX-512 without BF16), else x as it is. q8 (the logits head) takes x as int16
        under either integer width, but for AVX-512 BF16's faster path of its own. On AMX
        tiles, and without AVX2, x stays as it is whatever is asked. For the whole process,
        which loads the library once."""
        if kind != AUTO and kind not in ACTIVATIONS:
            choices = ", ".join([AUTO, *ACTIVATIONS])
            raise ValueError(f"activations {kind!r}: choose one of {choices}")
        self._set_bits(self._activation_bits(-2 if kind == AUTO else ACTIVATIONS[kind]))

    def batch_invariant(self, on: bool) -> None:
        """Whether each row of x is computed alike whatever the number of rows (the default):
        one path for every row count, so that a token's outputs do not depend on its step's
        other tokens. Off, paths are picked by row count for speed (AMX tiles from a few rows,
        integer x from two, torch's float32 matmul for wide inputs without either). For the
        whole process, as `use_activations`."""
        self.invariant = bool(self._invariant(int(on)))
        self._set_bits(self.activation_bits)

    def _set_bits(self, bits: int) -> None:
        # q4 quantizes x to integers of this many bits (0: it multiplies x in float32)
        self.activation_bits = bits
        # q4 runs on AMX tiles from this many rows of x (0: never, on this CPU or build)
        self.tile_min_rows = self._tile_min_rows()
        # without tiles or integers, q4 of this many rows or more goes to torch's float32
        # matmul; never where each row must be computed alike
        self.sgemm_min_rows = sgemm_min_rows(self.tile_min_rows, bits, self.invariant)

    @property
    def c_max_rows(self) -> int:
        """Rows of x up to which q4 runs in C; from `sgemm_min_rows` it calls torch."""
        return self.sgemm_min_rows - 1 if self.sgemm_min_rows else sys.maxsize

    @classmethod
    def load(cls, extra_flags: tuple[str, ...] = ()) -> QuantMatmul | None:
        lib = load_library(SOURCE, extra_flags)
        return None if lib is None else cls(lib)

    @staticmethod
    def takes(rows: int, cols: int) -> bool:
        return rows % LANES == 0 and cols % GROUP == 0

    @staticmethod
    def pack_q4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """q [N, K] integers in 0..15, scale and low [N, K / 32] -> [N / 16, K / 32, Q4_BYTES]
        for W[n, 32g + j] = q[n, 32g + j] * scale[n, g] + low[n, g]."""
        N, K = q.shape
        blocks, groups = N // LANES, K // GROUP
        # j = 16h + 2c + e: chunk c, byte 2i + e of row i holds h = 0 low and h = 1 high
        qv = q.to(torch.uint8).view(blocks, LANES, groups, 2, 8, 2)
        quants = (qv[:, :, :, 0] | (qv[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
        parts = [quants, _per_block(scale), _per_block(low)]
        return torch.cat([_as_bytes(p, blocks, groups) for p in parts], dim=-1)

    @staticmethod
    def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """q [N, K] integers in -127..127, scale [N, K / 32] -> [N / 16, K / 32, Q8_BYTES]
        for W[n, 32g + j] = q[n, 32g + j] * scale[n, g]."""
        N, K = q.shape
        blocks, groups = N // LANES, K // GROUP
        quants = q.to(torch.int8).view(blocks, LANES, groups, GROUP).permute(0, 2, 3, 1)
        parts = [quants, _per_block(scale)]
        return torch.cat([_as_bytes(p, blocks, groups) for p in parts], dim=-1)

    def quantize_q4(self, weight: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """A weight [N, K] on Q4_1 grids -> its q4 layout, as `pack_q4` lays out each group's q
        on 15 steps from its minimum to its maximum (low and step rounded to float16), and how
        far the farthest weight lies from its grid point, in steps (0 up to float rounding: the
        weight came from a Q4_1 file). None if a low or step is not finite in float16. One pass
        in C, faster than the same steps as torch operations (docs/performance.md)."""
        return self._quantize("q4", Q4_BYTES, weight)

    def quantize_q8(self, weight: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """The same for Q8_0 (`pack_q8`): each group's scale its largest |w| / 127, rounded to
        float16, and q in -127..127."""
        return self._quantize("q8", Q8_BYTES, weight)

    def _quantize(self, kind: str, nbytes: int, weight: torch.Tensor):
        N, K = weight.shape
        if not self.takes(N, K):
            raise ValueError(f"{kind}: a [{N}, {K}] weight is not in blocks of {LANES} x {GROUP}")
        w = weight.detach().float().contiguous()
        out = torch.empty(N // LANES, K // GROUP, nbytes, dtype=torch.uint8)
        error = self.quantizers[kind](w.data_ptr(), out.data_ptr(), N, K)
        return None if error < 0 else (out, error)

    def q4(self, x: torch.Tensor, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """x [B, K] bfloat16 -> [B, rows] bfloat16, for `packed` from `pack_q4` of [rows, K]."""
        if self.sgemm_min_rows and x.shape[0] >= self.sgemm_min_rows:
            self._check("q4", Q4_BYTES, x, packed, rows)
            return torch.nn.functional.linear(
                x.float(), self.dequantize_q4(packed, rows)
            ).bfloat16()
        return self._call("q4", Q4_BYTES, x, packed, rows)

    def q4_silu(self, x: torch.Tensor, packed: torch.Tensor, rows: int) -> torch.Tensor | None:
        """silu(gate) * up [B, rows / 2] bfloat16 for a gate/up projection `packed` of `rows`
        rows (the gate's, then the up's), in one pass on whichever path `q4` takes: its bits and
        then silu_and_mul's. None in a build without AVX2 (plain C)."""
        x = x.contiguous()
        self._check("q4", Q4_BYTES, x, packed, rows)
        act = torch.empty(x.shape[0], rows // 2, dtype=torch.bfloat16)
        done = self.silu_fn(x.data_ptr(), packed.data_ptr(), act.data_ptr(), x.shape[0],
                            rows // 2, x.shape[1])  # fmt: skip
        return act if done else None

    def dequantize_q4(self, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """The float32 weight [rows, K] that `packed` holds, in a buffer that the next call
        overwrites."""
        K = packed.shape[1] * GROUP
        if self._scratch.numel() < rows * K:
            self._scratch = torch.empty(rows * K)
        out = self._scratch[: rows * K].view(rows, K)
        self._dequantize(packed.data_ptr(), out.data_ptr(), rows, K)
        return out

    def q8(self, x: torch.Tensor, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """x [B, K] bfloat16 -> [B, rows] float32 (logits are not rounded to bfloat16), for
        `packed` from `pack_q8` of [rows, K]."""
        return self._call("q8", Q8_BYTES, x, packed, rows, torch.float32)

    def _check(self, kind, block_bytes, x, packed, rows) -> None:
        B, K = x.shape
        if (
            x.dtype != torch.bfloat16
            or not x.is_cpu
            or not self.takes(rows, K)
            or packed.shape != (rows // LANES, K // GROUP, block_bytes)
        ):
            raise ValueError(
                f"{kind}_matmul: x {tuple(x.shape)} {x.dtype} does not fit a packed weight of "
                f"{rows} rows, shape {tuple(packed.shape)}"
            )

    def _call(self, kind, block_bytes, x, packed, rows, dtype=torch.bfloat16) -> torch.Tensor:
        x = x.contiguous()
        self._check(kind, block_bytes, x, packed, rows)
        B, K = x.shape
        y = torch.empty(B, rows, dtype=dtype)
        self.fns[kind](x.data_ptr(), packed.data_ptr(), y.data_ptr(), B, rows, K)
        return y

    # -- GGUF blocks as the file holds them (the K-quants of a Q4_K_M file, and Q8_0) ----------

    def gguf(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        qtype: int,
        rows: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """x [B, K] bfloat16 -> [B, rows] bfloat16 (or float32: `dtype`, for logits), for
        `blocks` [rows, K / QK * block bytes] uint8: each row of W as the GGUF file's blocks of
        `qtype` (a `GGUF_KERNEL_TYPES` value). Every row count takes the same path: batch
        invariant."""
        x = x.contiguous()
        K = gguf_row_elements(qtype, blocks.shape[1])
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[1] != K or blocks.shape[0] != rows:
            raise ValueError(
                f"gguf_matmul: x {tuple(x.shape)} {x.dtype} does not fit {rows} rows of "
                f"{GGUF_KERNEL_TYPES[qtype]} blocks, shape {tuple(blocks.shape)}"
            )
        y = torch.empty(x.shape[0], rows, dtype=dtype)
        f32 = int(dtype == torch.float32)
        self._gguf(qtype, x.data_ptr(), blocks.data_ptr(), y.data_ptr(), x.shape[0], rows, K, f32)
        return y

    def gguf_dequantize(self, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        """The float32 weight [rows, K] that `blocks` hold, as gguf's dequantization gives it."""
        rows, K = blocks.shape[0], gguf_row_elements(qtype, blocks.shape[1])
        out = torch.empty(rows, K)
        self._gguf_dequantize(qtype, blocks.data_ptr(), out.data_ptr(), rows, K)
        return out


# GGUF type number (gguf.GGMLQuantizationType) -> name, weights per block and bytes per block,
# for the types `gguf_matmul_bf16` reads.
GGUF_KERNEL_TYPES = {8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
GGUF_BLOCKS = {8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


def gguf_row_elements(qtype: int, row_bytes: int) -> int:
    """Weights in a row of `row_bytes` bytes of `qtype` blocks."""
    if qtype not in GGUF_BLOCKS:
        raise ValueError(f"GGUF type {qtype} is not one the C kernel reads")
    per_block, nbytes = GGUF_BLOCKS[qtype]
    if row_bytes % nbytes:
        raise ValueError(
            f"a row of {row_bytes} bytes is not whole {GGUF_KERNEL_TYPES[qtype]} blocks"
        )
    return row_bytes // nbytes * per_block
