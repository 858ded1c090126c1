"""Which code path each part of a step takes on this CPU: the one place that decides.

Two things pick a path. The C kernels' builds pick their code with `#if` on the CPU's features
(`variants.py` names the builds; the engine loads the native one, or $SERVELM_KERNEL_VARIANT's).
Then the Python side picks, by the CPU and the number of rows (tokens) in a matmul, between the
C kernels, oneDNN and torch: that choice is this table, made from the loaded C matmul kernel
(None: none built) and read by the layers (`model/layers/linear.py`), the C layer loop
(`worker/decode_stack.py`), the start-up log and, through `ModelRunner.step_paths`, the
simulator's calibration.

    paths = StepPaths.of(kernel)    # kernel: QuantMatmul | None
    paths.int4_max_rows             # a matmul of up to this many rows reads the int4 weight

Batch invariant (the default, `QuantMatmul.batch_invariant`), no cut-off depends on rows: every
input takes the C kernels' one path, so that a token's numbers do not depend on what else its
step holds. The cut-offs below are the faster choices `--no-batch-invariant` keeps; the
measurements behind each are in docs/performance.md ("Numbers behind code comments").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelm.kernels.quant_matmul import QuantMatmul

ALL_ROWS = sys.maxsize  # a path that serves every input
NEVER = 0  # a "from this many rows" that is never reached

# AMX tiles take q4 from this many rows (the vector path is faster below), and integer x from
# this many (the float32 path is as fast at one row); passed to the C kernel when it loads.
AMX_MIN_ROWS = 6
INT_X_MIN_ROWS = 2
# torch's CPU int4 kernel (no C kernel): it unpacks every weight for each block of rows, so it
# wins only where reading the weight is the whole cost.
TORCH_INT4_MAX_ROWS = 8
# servelm's C int4 matmul on its AVX-512 vector path, where oneDNN multiplies bf16 faster from
# here (a CPU without AMX tiles, such as Ice Lake).
C_INT4_VECTOR_MAX_ROWS = 16
# The Q8_0 logits head, where oneDNN's bf16 matmul is faster from here.
HEAD_Q8_MAX_ROWS = 8
# Without oneDNN's bf16 matmul (an AVX2-only CPU), a float32 copy of a bf16 weight, made for the
# call, is faster than torch's bf16 fallback from this many rows.
BF16_VIA_F32_MIN_ROWS = 8
# Without AMX tiles or integer x (`--int4-activations float32` on an AVX2-only CPU), q4 from this
# many rows dequantizes the weight to float32 for torch's float32 matmul.
SGEMM_MIN_ROWS = 192


@cache
def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT. Elsewhere (an AVX2-only AMD EPYC, say) torch's bf16 matmul is a slow
    fallback, several times slower than float32."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: assume it does
        return True


@cache
def bf16_via_f32_min_rows() -> int:
    """Rows from which a bf16 matmul goes through float32 on this CPU (NEVER: it does not).
    Asked by every plain bf16 matmul, so decided once."""
    return NEVER if cpu_has_bf16_matmul() else BF16_VIA_F32_MIN_ROWS


def sgemm_min_rows(tile_min_rows: int, activation_bits: int, invariant: bool) -> int:
    """Rows from which the C q4 matmul hands x to torch's float32 matmul (NEVER: it does not)."""
    return NEVER if tile_min_rows or activation_bits or invariant else SGEMM_MIN_ROWS


@dataclass(frozen=True)
class StepPaths:
    invariant: bool  # one path for every row count (see the top of the file)
    bf16_matmul: bool  # oneDNN multiplies bf16 on this CPU
    c_kernel: bool  # servelm's C matmul kernel is built
    tile_min_rows: int  # q4 runs on AMX tiles from this many rows (NEVER: no tiles)
    activation_bits: int  # q4 quantizes x to integers of this width (0: float32)
    int4_max_rows: int  # int4 weights serve inputs of up to this many rows; bf16 beyond
    head_q8_max_rows: int  # an exact Q8_0 head serves up to this many rows; float32 beyond
    bf16_via_f32_min_rows: int  # a bf16 matmul goes through float32 from here (NEVER: no)
    sgemm_min_rows: int  # q4 goes to torch's float32 matmul from here (NEVER: no)
    # a GGUF file's own quantized projections (K-quants, Q8_0) serve inputs of up to this many
    # rows: every input, batch invariant or not, since no bf16 copy is kept to hand wider ones
    # to (a prompt then runs at the kernel's FMA speed, not oneDNN's; docs/performance.md)
    gguf_max_rows: int = ALL_ROWS

    @classmethod
    def of(cls, kernel: QuantMatmul | None) -> StepPaths:
        """The table for this CPU and `kernel` (its invariance and activation settings)."""
        bf16 = cpu_has_bf16_matmul()
        c = kernel is not None
        invariant = c and kernel.invariant
        tiles = kernel.tile_min_rows if c else NEVER
        if not c:
            int4 = TORCH_INT4_MAX_ROWS
        elif invariant or tiles or not bf16 or kernel.activation_bits == 8:
            # tiles, float32 vectors (no oneDNN bf16 here), or int8 x (1.13-1.69x oneDNN's
            # bf16 at 17-1,024 rows on the Zen 4: docs/performance.md, session 28) serve all
            int4 = ALL_ROWS
        else:
            int4 = C_INT4_VECTOR_MAX_ROWS
        return cls(
            invariant=invariant,
            bf16_matmul=bf16,
            c_kernel=c,
            tile_min_rows=tiles,
            activation_bits=kernel.activation_bits if c else 0,
            int4_max_rows=int4,
            head_q8_max_rows=ALL_ROWS if invariant or not bf16 else HEAD_Q8_MAX_ROWS,
            bf16_via_f32_min_rows=bf16_via_f32_min_rows(),
            sgemm_min_rows=kernel.sgemm_min_rows if c else NEVER,
            gguf_max_rows=ALL_ROWS if c else NEVER,
        )

    @property
    def stack_max_rows(self) -> int:
        """Steps of up to this many tokens can run all their layers in one C call: those whose
        int4 matmuls all stay in C."""
        wide = self.sgemm_min_rows - 1 if self.sgemm_min_rows else ALL_ROWS
        return min(self.int4_max_rows, wide) if self.c_kernel else NEVER

    def summary(self) -> str:
        """One line for the start-up log."""

        def rows(n: int) -> str:
            return "every input" if n == ALL_ROWS else f"up to {n} rows"

        parts = ["batch invariant" if self.invariant else "paths by row count"]
        if self.c_kernel:
            if self.tile_min_rows:
                parts.append(f"q4 on AMX tiles from {self.tile_min_rows} row(s)")
            elif self.activation_bits:
                parts.append(f"q4 with x as int{self.activation_bits}")
            parts.append(f"C int4 matmuls: {rows(self.int4_max_rows)}")
            parts.append(f"Q8_0 head: {rows(self.head_q8_max_rows)}")
            if self.sgemm_min_rows:
                parts.append(f"torch float32 from {self.sgemm_min_rows} rows")
        if not self.bf16_matmul:
            parts.append(f"bf16 via float32 from {self.bf16_via_f32_min_rows} rows")
        return "; ".join(parts)
