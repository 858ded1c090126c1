"""Linear layers whose weights can be repacked once, after loading, for the CPU's matmul library.

On a CPU with bf16 weights, `F.linear` re-lays-out the weight for oneDNN on every call; a decode
step (one token per request) is nothing but reading weights, so that per-call work dominates.
`pack_for_cpu` reorders each weight once into oneDNN's blocked layout (the same thing
torch.compile's CPU freezing pass does) and the forward then calls the packed kernel: the result
is bit-identical to `F.linear`, and faster (docs/performance.md). On CUDA, or in float32,
nothing is packed; nor on a CPU whose oneDNN has no bf16 matmul (AVX2 only, such as an AMD EPYC
before Zen 4), where torch's bf16 matmul is a slow fallback and inputs of 8 rows or more are
multiplied in float32 instead.

A `Linear` may also carry its weight as 4-bit integers (`Int4Weight`): a decode step reads every
weight once, and 4-bit weights are a quarter of the bytes. The default model comes from a Q4_1
GGUF, whose weights are 4-bit already, so for it this is exact; its logits head is Q8_0 in the
file, and `Q8Weight` serves from those int8 values. Both are multiplied by servelm's C kernel
(`kernels/quant_matmul.c`) where it is built, else (int4 only, decode-sized inputs) by torch's
CPU int4 kernel. The C kernel multiplies by exactly the bf16 weight the 4-bit one stands for
(up to the inputs' int16 rounding on an AVX2 path: `QuantMatmul.use_activations`). Batch
invariant (the default) it serves every input, and the layer keeps no bf16 copy; with paths by
row count it still does on a CPU with AMX tiles or without oneDNN's bf16 matmul
(`kernels/paths.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels.paths import (
    ALL_ROWS,
    StepPaths,
    bf16_via_f32_min_rows,
    cpu_has_bf16_matmul,
)
from servelm.kernels.quant_matmul import QuantMatmul


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN takes this weight in its blocked bf16 layout."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_has_bf16_matmul()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear`, in float32 where that is faster for bfloat16 on this CPU (`kernels/paths.py`)."""
    from_rows = bf16_via_f32_min_rows()
    if (
        weight.dtype == torch.bfloat16
        and from_rows
        and x.numel() >= from_rows * x.shape[-1]
        and x.device.type == "cpu"
    ):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


# torch's CPU int4 kernel: groups of 32 inputs share a scale and an offset.
INT4_GROUP = 32
# A weight whose values all lie on their group's 4-bit grid (up to float rounding) loses
# nothing in int4; the distance is measured in grid steps (RTN quantization's worst is 0.5).
INT4_LOSSLESS_STEPS = 1e-3


def can_int4(weight: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Whether torch's CPU int4 kernel takes this weight, for activations of `dtype`. `device`:
    where the weight will live, for one not allocated yet (on the meta device)."""
    rows, cols = weight.shape
    return (
        (device or weight.device).type == "cpu"
        and dtype == torch.bfloat16
        and rows % 16 == 0
        and cols % INT4_GROUP == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def _on_grid(
    groups: torch.Tensor, low: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Each value of `groups` in grid steps above its group's `low`, rounded, and the largest
    distance to that grid, in steps (0 up to float rounding: the values lie on it). A group of
    step 0 is constant: every q is 0."""
    exact = (groups - low).div_(torch.where(step == 0, 1.0, step))
    q = exact.round()
    return q, exact.sub_(q).abs_().max().item()


class Int4Weight:
    """A weight matrix as 4-bit integers q in groups of `INT4_GROUP` along each row, each group
    with a scale and a low: w = q * scale + low, a GGUF Q4_1 block's form.

    Made from the float32 weight by rounding to each group's grid from its minimum to its
    maximum in 15 steps: weights that came from a Q4_1 file are recovered exactly, and `error`
    (in grid steps) says whether that happened. With servelm's C kernel (`kernel`) the weight is
    kept in its layout, scales and lows in float16 as the file has them; otherwise in the layout
    of torch's int4 kernel, whose scales are in the activations' dtype.
    """

    def __init__(
        self, weight: torch.Tensor, dtype: torch.dtype, kernel: QuantMatmul | None = None
    ) -> None:
        rows, cols = weight.shape
        if kernel is not None:  # the kernel reads the grid in float16, and makes it itself
            made = kernel.quantize_q4(weight)
            if made is not None:
                packed, self.error = made
                self._keep(packed, rows, kernel)
                return
            # beyond float16's range: torch's kernel takes the scales as they are
        groups = weight.detach().float().view(rows, cols // INT4_GROUP, INT4_GROUP)
        low = groups.amin(-1, keepdim=True)
        step = (groups.amax(-1, keepdim=True) - low) / 15
        q, self.error = _on_grid(groups, low, step)
        q = q.clamp_(0, 15).view(rows, cols)
        self.rows, self.kernel = rows, None
        self.max_rows = StepPaths.of(None).int4_max_rows
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # torch's form: w = (q - 8) * scale + zero, as [groups, rows, (scale, zero)]
        scale_zero = torch.cat([step, low + 8 * step], dim=-1)
        self.scales_zeros = scale_zero.transpose(0, 1).contiguous().to(dtype)
        self.nbytes = self.packed.nbytes + self.scales_zeros.nbytes

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, rows: int, error: float, kernel: QuantMatmul
    ) -> Int4Weight:
        """One made before and kept (`model/packed_cache.py`): `packed` from the C kernel's
        `pack_q4` of a [rows, K] weight, `error` as it was then."""
        self = cls.__new__(cls)
        self.error = error
        self._keep(packed, rows, kernel)
        return self

    def _keep(self, packed: torch.Tensor, rows: int, kernel: QuantMatmul) -> None:
        """Serve from `packed`, the C kernel's layout of a [rows, K] weight."""
        self.rows, self.kernel = rows, kernel
        self.max_rows = StepPaths.of(kernel).int4_max_rows
        self.packed, self.nbytes = packed, packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.q4(x, self.packed, self.rows)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, INT4_GROUP, self.scales_zeros
        )


class Q8Weight:
    """A weight on GGUF Q8_0's grid: int8 in groups of 32 along each row, a float16 scale per
    group (w = q * scale), the default model's logits head. Kept as such only for servelm's C
    kernel, and only when the weight lies on that grid exactly."""

    def __init__(self, packed: torch.Tensor, rows: int, kernel: QuantMatmul) -> None:
        """`packed`: the C kernel's q8 layout of a [rows, K] weight (`quantize_q8`)."""
        self.rows, self.kernel, self.packed, self.nbytes = rows, kernel, packed, packed.nbytes

    @classmethod
    def exact(cls, weight: torch.Tensor, kernel: QuantMatmul) -> Q8Weight | None:
        """The weight's Q8_0 form, made from its float32 values; None unless that loses nothing.
        A Q8_0 group's scale is its largest |w| / 127 (the quantizer puts that weight at 127)."""
        rows, cols = weight.shape
        if not kernel.takes(rows, cols):
            return None
        made = kernel.quantize_q8(weight)
        if made is None or made[1] > INT4_LOSSLESS_STEPS:
            return None
        return cls(made[0], rows, kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.q8(x, self.packed, self.rows)


def _merged(parts: list[tuple[int, int, str, object]]) -> list[tuple[int, int, str, object]]:
    """Adjacent parts of one form stacked into one (gate and up, q and k): one kernel call
    instead of two. Every layout stacks along its first dimension (rows, or blocks of 16)."""
    out: list[tuple[int, int, str, object]] = []
    for start, rows, kind, data in parts:
        if out and out[-1][2] == kind and (kind != "gguf" or out[-1][3][0] == data[0]):
            s0, r0, _, d0 = out[-1]
            if kind == "gguf":
                merged = (data[0], torch.cat([d0[1], data[1]]))
            else:
                merged = torch.cat([d0, data])
            out[-1] = (s0, r0 + rows, kind, merged)
        else:
            out.append((start, rows, kind, data))
    return out


class GGUFWeight:
    """A projection served from a GGUF file's own quantized values, by servelm's C kernel: its
    rows in parts (the checkpoint tensors a fused projection stacks: q, k, v), each part one
    of: the file's Q4_K / Q5_K / Q6_K / Q8_0 blocks as they are (`QuantMatmul.gguf`), the q8
    layout of a Q8_0 part (the head's kernel, where it takes the shape), or the q4 layout of a
    Q4_1 part. Each part is checked at load to hold exactly the checkpoint's weights
    (model/loader.py); the layer then keeps no bf16 copy. Every row count takes the same code:
    batch invariant."""

    def __init__(self, parts: list[tuple[int, int, str, object]], kernel: QuantMatmul) -> None:
        """`parts`: (first row, rows, kind, data) in row order, kind "gguf" with data (type,
        blocks), "q8" or "q4" with data the packed tensor."""
        from servelm.kernels.quant_matmul import GGUF_KERNEL_TYPES

        names = {"q8": "Q8_0", "q4": "Q4_1"}
        self._kinds = [
            GGUF_KERNEL_TYPES[data[0]] if kind == "gguf" else names[kind]
            for _, _, kind, data in parts
        ]
        self.parts, self.kernel = _merged(parts), kernel
        self.rows = sum(p[1] for p in parts)
        self.max_rows = StepPaths.of(kernel).gguf_max_rows
        self.nbytes = sum(
            (data[1] if kind == "gguf" else data).nbytes for _, _, kind, data in self.parts
        )

    def kinds(self) -> list[str]:
        """Each part's form as given (before merging), for the start-up log: "Q4_K", "Q8_0",
        "Q4_1"."""
        return self._kinds

    def _part(self, x: torch.Tensor, rows: int, kind: str, data) -> torch.Tensor:
        if kind == "gguf":
            return self.kernel.gguf(x, data[1], data[0], rows)
        if kind == "q8":
            return self.kernel.q8(x, data, rows).to(torch.bfloat16)
        return self.kernel.q4(x, data, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if len(self.parts) == 1:
            _, rows, kind, data = self.parts[0]
            return self._part(x, rows, kind, data)
        out = x.new_empty(x.shape[0], self.rows)
        for start, rows, kind, data in self.parts:
            out[:, start : start + rows] = self._part(x, rows, kind, data)
        return out


class GGUFHead:
    """The logits head as a GGUF file's own blocks (a Q4_K_M file's Q6_K `output.weight`, or
    its embedding where the head shares it), for `LogitsHead` in place of a `Q8Weight`: the
    same C kernel as `GGUFWeight`'s, with float32 logits."""

    def __init__(self, blocks: torch.Tensor, qtype: int, kernel: QuantMatmul) -> None:
        self.blocks, self.qtype, self.kernel = blocks, qtype, kernel
        self.rows, self.nbytes = blocks.shape[0], blocks.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.gguf(x, self.blocks, self.qtype, self.rows, torch.float32)


class Linear(nn.Linear):
    """`nn.Linear` plus optional faster forms of the weight: a packed copy, which replaces
    the plain weight once made, an int4 copy for inputs of up to `int4.max_rows` rows, and a
    GGUF file's own quantized values (`quant`, for up to `quant.max_rows`)."""

    packed: torch.Tensor | None = None
    int4: Int4Weight | None = None
    quant: GGUFWeight | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # (model/parallel.py)

    def use_quant(self, weight: GGUFWeight) -> None:
        """Serve inputs of up to `weight.max_rows` rows from `weight`; if that is every input,
        the plain weight is no longer read, and its memory is freed."""
        self.quant = weight
        if weight.max_rows == ALL_ROWS:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def reset_parameters(self) -> None:
        """Nothing to initialise: `load_weights` fills the weights."""

    def use_int4(self, weight: Int4Weight) -> None:
        """Serve inputs of up to `weight.max_rows` rows from `weight`; if that is every input,
        the plain weight is no longer read, and its memory is freed."""
        self.int4 = weight
        if weight.max_rows == ALL_ROWS:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack_for_cpu(self) -> None:
        if self.packed is None and self.weight.numel() and can_pack(self.weight):
            self.packed = _pack(self.weight)
            # The plain weight is no longer read; free its memory (in/out_features remain).
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        # row-parallel under tensor parallelism: this rank's partial sum, summed across ranks
        return out if self.reduce is None else self.reduce(out)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and x.shape[0] <= self.quant.max_rows:
            out = self.quant(x)
            return out if self.bias is None else out.add_(self.bias)
        if self.int4 is not None and x.shape[0] <= self.int4.max_rows:
            out = self.int4(x)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return plain_linear(x, self.weight, self.bias)


# Without a Q8_0 copy for every row, a batch-invariant head multiplies in chunks of exactly this
# many rows (the last padded): torch then takes one code path for every call, whatever the
# number of rows the step samples.
HEAD_CHUNK_ROWS = 16


class LogitsHead:
    """The output projection, which may share its weight with the token embedding, in float32:
    logits are not rounded to bfloat16 (two tokens a rounding apart would tie). With an exact
    Q8_0 copy (`q8`), decode-sized inputs (every input, batch invariant) read that, a little
    over half the bytes; otherwise the CPU multiplies by a float32 copy of the weight (bfloat16
    products are exact in float32)."""

    def __init__(
        self,
        weight: torch.Tensor,
        q8: Q8Weight | GGUFHead | None = None,
        invariant: bool = False,
    ) -> None:
        self.q8, self.invariant = q8, invariant
        self.q8_max_rows = StepPaths.of(q8.kernel).head_q8_max_rows if q8 is not None else 0
        # Only the form that is used is kept (a tied embedding keeps its own reference).
        if q8 is not None and self.q8_max_rows == ALL_ROWS:
            self.weight = None
        elif weight.device.type == "cpu":
            self.weight = weight.detach().float()
        else:
            self.weight = weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None and hidden.shape[0] <= self.q8_max_rows:
            return self.q8(hidden)
        if not self.invariant or hidden.shape[0] == HEAD_CHUNK_ROWS:
            return self._float32(hidden)
        rows = hidden.shape[0]
        padded = hidden.new_zeros(-(-rows // HEAD_CHUNK_ROWS) * HEAD_CHUNK_ROWS, hidden.shape[1])
        padded[:rows] = hidden
        chunks = [self._float32(c) for c in padded.split(HEAD_CHUNK_ROWS)]
        return torch.cat(chunks)[:rows]

    def _float32(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return F.linear(hidden.float(), self.weight)
        try:  # a GPU's half-precision matmul, accumulated and returned in float32
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            return F.linear(hidden.float(), self.weight.float())


def pack_linears_for_cpu(model: nn.Module) -> None:
    """Pack every `Linear` in `model` whose weight gains from it."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()


def int4_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, Linear]:
    """The `Linear`s of `model` whose weights the int4 kernels take, by module name; `device`:
    where the weights live (or will: this reads a model still on the meta device too). An
    untied `lm_head` is not one: the logits head serves it (an exact Q8_0 copy or the weight)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Linear) and name != "lm_head" and can_int4(m.weight, dtype, device)
    }


def quantize_linears_int4(
    linears: Iterable[Linear],
    dtype: torch.dtype,
    lossless_only: bool,
    kernel: QuantMatmul | None = None,
) -> int:
    """Give each of `linears` (`int4_linears`) an int4 copy, made from its current (float32)
    weight; returns how many got one. With `lossless_only`, all or none: if any weight is not
    4-bit already, nothing is quantized. `kernel`: servelm's C kernel, which then serves these
    copies in place of torch's."""
    made = []
    for module in linears:
        weight = Int4Weight(module.weight, dtype, kernel)
        if lossless_only and weight.error > INT4_LOSSLESS_STEPS:
            return 0
        made.append((module, weight))
    for module, weight in made:
        module.use_int4(weight)
    return len(made)
