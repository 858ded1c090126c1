"""Tensor parallelism inside the model: which slice of each weight a rank holds, and the
collectives that put the ranks' partial results together.

Rank r of N holds:

    q/k/v, gate/up (column-parallel)   its rows: N's share of the heads / of the MLP width
    o, down (row-parallel)             its columns; the partial outputs are summed (all-reduce)
    embedding, logits head             its share of the vocabulary (rows): a token's row lives
                                       on one rank, so the lookup is summed across ranks and
                                       the logits are gathered
    norms, per-head norms              everything (replicated)

KV heads are split like query heads when there are at least N of them, and otherwise each rank
keeps the one its query heads read (replicated). Which numbers divide is decided where
`servelm plan` decides it (`planner.shapes.ModelShape.check_tp`), so the planner's per-rank
memory and the engine's agree.

Each rank reads only its slices of the checkpoint (`TPSlicer`): safetensors files are
memory-mapped and a slice copies just its rows or columns; `bytes_read` counts them.

Two all-reduces per layer plus one for the embedding and one all-gather of the logits make a
step's collectives (`collectives_per_step`); `servelm plan --tp` reports the same count.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from servelm.model.config import ModelConfigError, ModelSpec

# checkpoint tensor (name ends with) -> (dimension sliced, what is split along it)
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
_LAYER_TENSOR = re.compile(r".*\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


@dataclass
class TPGroup:
    """This process's place among the ranks, and the collectives the layers call.

    `pg` is a process group of its own (gloo, or NCCL on CUDA), not torch.distributed's
    global default group: an engine that stops leaves nothing behind for the next one in the
    same process. `collectives` counts the calls (a test holds them to the planner's count)."""

    rank: int
    size: int
    pg: dist.ProcessGroup | None = None
    collectives: int = 0
    shm: object | None = None  # worker/shm_allreduce.py's ShmAllReduce, on one x86 host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.collectives += 1
        if self.shm is not None and self.shm.fits(x):  # (every rank decides alike: same x)
            return self.shm.all_reduce(x)
        self.pg.allreduce([x]).wait()
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, c] on every rank -> [rows, size * c], rank 0's columns first."""
        self.collectives += 1
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=1)


def process_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout, shm=None
) -> TPGroup:
    """Join the ranks meeting at `store`: gloo over loopback on a CPU, NCCL on CUDA; `shm`
    carries the CPU's all-reduces that fit it."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # loopback, whatever the host name resolves to: the ranks share this machine
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, rank, size, options)
    return TPGroup(rank, size, pg, shm=shm)


def collectives_per_step(spec: ModelSpec, tp: int) -> int:
    """All-reduces and all-gathers one forward makes at tensor-parallel size `tp` (0 at 1):
    the planner's count (`servelm plan --tp`), which a test holds to the collectives made."""
    return _shape(spec).collectives_per_step(tp)


def check_supported(spec: ModelSpec, checkpoint_names: list[str], tp: int) -> None:
    """Raise ModelConfigError naming what cannot be split across `tp` ranks: the heads or the
    MLP width (as `servelm plan` decides), or a layer tensor of a form this code does not
    slice (a fused qkv_proj, experts)."""
    from servelm.planner.shapes import ShapeError

    try:
        _shape(spec).check_tp(tp)
    except ShapeError as exc:
        raise ModelConfigError(f"--tensor-parallel-size {tp}: {exc}") from exc
    if spec.num_experts:
        raise ModelConfigError(
            f"--tensor-parallel-size {tp}: {spec.architecture} is a mixture of experts, which "
            "servelm does not split across ranks yet"
        )
    for name in checkpoint_names:
        match = _LAYER_TENSOR.fullmatch(name)
        if match and match.group(2) not in _COLUMN and match.group(2) not in _ROW:
            if not name.endswith(("q_norm.weight", "k_norm.weight")):
                raise ModelConfigError(
                    f"--tensor-parallel-size {tp}: {spec.architecture}'s tensor {name} is not "
                    "one servelm knows how to split (q/k/v/o, gate/up/down projections)"
                )


def _shape(spec: ModelSpec):
    from servelm.planner.shapes import ModelShape

    return ModelShape(
        name=spec.architecture,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        tie_embeddings=spec.tie_word_embeddings,
        max_context=spec.max_position_embeddings,
    )


def rank_spec(spec: ModelSpec, tp: TPGroup) -> ModelSpec:
    """The model one rank builds: its share of the heads, the MLP width and the vocabulary
    (rounded up: the last rank's extra rows are zeros, cut from the gathered logits)."""
    q_heads, kv_heads = _shape(spec).heads_per_gpu(tp.size)
    return dataclasses.replace(
        spec,
        num_heads=q_heads,
        num_kv_heads=kv_heads,
        intermediate_size=spec.intermediate_size // tp.size,
        vocab_size=-(-spec.vocab_size // tp.size),
    )


class TPSlicer:
    """Which part of each checkpoint tensor rank `tp.rank` reads, and the bytes it has read."""

    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        self.spec, self.tp = spec, tp
        local = rank_spec(spec, tp)
        d, r = spec.head_dim, tp.rank
        first_kv = r * spec.num_kv_heads // tp.size  # (the replicated head where fewer)
        self.ranges = {  # what is split -> (first element, elements) along the sliced dim
            "q": (r * local.num_heads * d, local.num_heads * d),
            "kv": (first_kv * d, local.num_kv_heads * d),
            "mlp": (r * local.intermediate_size, local.intermediate_size),
            "vocab": (r * local.vocab_size, local.vocab_size),
        }
        self.bytes_read = 0

    def part(self, name: str) -> tuple[int, tuple[int, int]] | None:
        """(dimension, (start, length)) of tensor `name` this rank holds; None: all of it."""
        if name.endswith(_VOCAB):
            return 0, self.ranges["vocab"]
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            return None
        proj, kind = match.group(2), match.group(3)
        if proj in _COLUMN:
            return 0, self.ranges[_COLUMN[proj]]
        if proj in _ROW:  # a row-parallel bias is whole; rank 0 alone adds it (`read`)
            return (1, self.ranges[_ROW[proj]]) if kind == "weight" else None
        return None

    def read(self, f, name: str) -> torch.Tensor:
        """This rank's part of `name` from an open safetensors file `f`, padded with zero rows
        where the vocabulary does not divide."""
        part = self.part(name)
        if part is None:
            tensor = f.get_tensor(name)
            if self.tp.rank and _is_row_bias(name):
                tensor = torch.zeros_like(tensor)  # summed across ranks: added once
        else:
            dim, (start, length) = part
            sliced = f.get_slice(name)
            size = sliced.get_shape()[dim]
            stop = min(start + length, size)
            index = slice(start, stop)
            tensor = sliced[index] if dim == 0 else sliced[:, index]
            if stop - start < length:  # the vocabulary's last rank
                tensor = F.pad(tensor, (0, 0, 0, length - max(stop - start, 0)))
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _is_row_bias(name: str) -> bool:
    match = _LAYER_TENSOR.fullmatch(name)
    return bool(match and match.group(2) in _ROW and match.group(3) == "bias")


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rows of `ids` from a table holding rank `tp.rank`'s share of the vocabulary: zero for
    ids another rank holds, then summed across ranks (one rank contributes each row)."""
    rows = weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.clamp(0, rows - 1), weight)
    out[outside] = 0
    return tp.all_reduce(out)


class GatheredLogits:
    """The logits head of a vocab-parallel model: each rank's columns, gathered, cut to the
    vocabulary (float32, as `LogitsHead` gives them)."""

    def __init__(self, head, tp: TPGroup, vocab_size: int) -> None:
        self.head, self.tp, self.vocab_size = head, tp, vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_columns(self.head(hidden))[:, : self.vocab_size]


def apply_tp(model, tp: TPGroup, vocab_size: int) -> None:
    """Wire a loaded rank's model to the others: sums after the row-parallel projections and
    the embedding, a gather after the logits head."""
    from servelm.model.layers.embedding import Embedding
    from servelm.model.layers.linear import Linear

    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in _ROW:
            module.reduce = tp.all_reduce
        elif isinstance(module, Embedding):
            module.tp = tp
    model.logits_head = GatheredLogits(model.logits_head, tp, vocab_size)
