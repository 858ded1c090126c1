"""Weight loading from `*.safetensors` (memory-mapped, sharded via the index) into a model.

Every failure names the file and the tensor: a missing shard, a missing tensor, a shape that
does not match the config. Checkpoint names are mapped onto fused parameters through the
model's `packed_modules`; each fused module carries `shards` saying which rows are whose.
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from servelm.kernels.paths import ALL_ROWS, StepPaths
from servelm.kernels.quant_matmul import GGUF_KERNEL_TYPES, GROUP, LANES, QuantMatmul
from servelm.model import packed_cache
from servelm.model.config import ModelConfigError
from servelm.model.layers.embedding import Embedding
from servelm.model.layers.linear import (
    INT4_LOSSLESS_STEPS,
    GGUFHead,
    GGUFWeight,
    Int4Weight,
    Linear,
    Q8Weight,
    can_int4,
    int4_linears,
    quantize_linears_int4,
)
from servelm.model.parallel import TPGroup, TPSlicer, apply_tp, rank_spec
from servelm.store.paths import GGUF_BLOCKS_FILE

logger = logging.getLogger(__name__)


class WeightLoadError(ModelConfigError):
    """A checkpoint the model cannot be loaded from, named in the message. A ValueError, as a
    bad config.json is: the CLI and the server report a model refused at start-up in one line."""


def _open_checkpoint(path: Path):
    """`safe_open` of one checkpoint file, or WeightLoadError naming it: safetensors' own error
    ("incomplete metadata, file not fully covered") names no file and reads like a bug."""
    try:
        return safe_open(str(path), framework="pt")
    except OSError as exc:
        raise WeightLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except SafetensorError as exc:
        raise WeightLoadError(
            f"{path} is not a valid, complete safetensors file: it is cut short or corrupt"
        ) from exc


class PackedShards:
    """Loads checkpoint tensors into their rows of a fused parameter (q/k/v, gate/up)."""

    def __init__(self, offsets: dict[str, tuple[int, int]]) -> None:
        self.offsets = offsets  # shard name -> (first row, number of rows)

    def shard_shape(self, param: torch.Tensor, shard: str) -> tuple[int, ...]:
        return (self.offsets[shard][1], *param.shape[1:])

    def __call__(self, param: torch.Tensor, tensor: torch.Tensor, shard: str) -> None:
        start, size = self.offsets[shard]
        param.data[start : start + size].copy_(tensor)


# Tensors some checkpoints carry that a model computes itself. Any other tensor the model has
# no parameter for is refused (`_refuse_unused`): a bias, a scale or a layer left unread would
# make the model served another than the checkpoint's.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except ValueError as exc:
            raise WeightLoadError(f"{index} is not valid JSON: {exc}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """Every tensor name in the checkpoint (the files' headers only)."""
    names: list[str] = []
    for path in safetensors_files(model_dir):
        with _open_checkpoint(path) as f:
            names.extend(f.keys())
    return names


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with _open_checkpoint(path) as f:
            for name in f.keys():
                yield path, name, f.get_tensor(name)


def _wanted_tensors(
    model_dir: str | Path, wanted, slicer: TPSlicer | None
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """The checkpoint's tensors named in `wanted`, each read only when reached (the files are
    memory-mapped): all of it, or under tensor parallelism this rank's slice."""
    for path in safetensors_files(model_dir):
        with _open_checkpoint(path) as f:
            for name in f.keys():
                if name in wanted:
                    yield path, name, slicer.read(f, name) if slicer else f.get_tensor(name)


def _refuse_unused(model: nn.Module, model_dir: str | Path, known: set[str]) -> None:
    """WeightLoadError naming the checkpoint tensors that are not `known` (those the model
    reads or was told to skip), nor computed by the model (`_IGNORED_SUFFIXES`), nor an untied
    copy of the embedding where the model ties its head to it (transformers ignores that too).
    Only the files' headers are read: refused before any weight is."""
    tied = getattr(model, "lm_head", None) is None
    unused = [
        name
        for name in checkpoint_names(model_dir)
        if name not in known
        and not name.endswith(_IGNORED_SUFFIXES)
        and not (tied and name == "lm_head.weight")
    ]
    if unused:
        arch = getattr(getattr(model, "spec", None), "architecture", type(model).__name__)
        raise WeightLoadError(
            f"checkpoint in {model_dir} has tensors servelm's {arch} does not use: "
            f"{_names_by_layer(unused)} (serving without them would compute another model "
            "than the checkpoint's: a config.json field servelm does not read, or a layout it "
            "does not know)"
        )


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    skip: frozenset[str] = frozenset(),
    slicer: TPSlicer | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, in the model's dtype;
    the parameters named in `skip` are neither read nor required. With `slicer` (tensor
    parallelism) each tensor's part this rank holds is read, and nothing else."""
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    # Which (checkpoint name) each of our parameter slices expects.
    expected: dict[str, tuple[str, str | None]] = {}
    skipped: set[str] = set()
    for pname, _ in model.named_parameters():
        ckpt = model.checkpoint_name(pname)
        targets = [(src, shard) for src, (frag, shard) in packed.items() if f".{frag}." in ckpt]
        names = {ckpt: None} if not targets else {}
        for src, shard in targets:
            names[ckpt.replace(f".{packed[src][0]}.", f".{src}.")] = shard
        if pname in skip:
            skipped.update(names)
        else:
            expected.update((name, (pname, shard)) for name, shard in names.items())
    _refuse_unused(model, model_dir, set(expected) | skipped)

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path, name, tensor in _wanted_tensors(model_dir, expected, slicer):
        pname, shard = expected[name]
        param = params[pname]
        # A fused module names which rows each checkpoint tensor fills (weight and bias alike).
        loader = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "shards", None)
        with torch.no_grad():
            if loader is not None:
                want = loader.shard_shape(param, shard)
                if tuple(tensor.shape) != want:
                    raise WeightLoadError(
                        f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {want} from config.json"
                    )
                loader(param, tensor, shard)  # copy_ converts the dtype
            else:
                if tensor.shape != param.shape:
                    raise WeightLoadError(
                        f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)} from config.json"
                    )
                param.data.copy_(tensor)
        loaded.add(name)

    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise WeightLoadError(f"checkpoint in {model_dir} lacks tensors: {shown}")


def _allocate_parameters(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    linear_dtype: torch.dtype,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Give every meta parameter uninitialised memory (what `to_empty` does, minus the cost of
    routing each allocation through torch's meta-tensor reference implementations);
    matmul weights (`Linear`, and the embedding, which may be the logits head) get
    `linear_dtype`. The parameters named in `skip` get none (an empty tensor)."""
    for prefix, module in model.named_modules():
        kind = linear_dtype if isinstance(module, (Linear, Embedding)) else dtype
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                full_name = f"{prefix}.{name}" if prefix else name
                shape = (0,) if full_name in skip else param.shape
                empty = torch.empty(shape, dtype=kind, device=device)
                module._parameters[name] = nn.Parameter(empty, requires_grad=False)


def _checkpoint_is_4bit(
    model_dir: str | Path, dtype: torch.dtype, slicer: TPSlicer | None = None
) -> bool:
    """Whether the checkpoint's first projection weight is 4-bit already (a dequantized Q4_1
    GGUF is): one tensor read (this rank's part of it), before any memory is allocated for
    the model."""
    if dtype != torch.bfloat16:  # (no int4 for any other: nothing to read)
        return False
    for path in safetensors_files(model_dir):
        with _open_checkpoint(path) as f:
            name = next((n for n in f.keys() if n.endswith("proj.weight")), None)
            if name is not None:
                tensor = slicer.read(f, name) if slicer else f.get_tensor(name)
                return can_int4(tensor, dtype) and (
                    Int4Weight(tensor, dtype).error <= INT4_LOSSLESS_STEPS
                )
    return False


def _kept_weights(
    model: nn.Module,
    linears: dict[str, Linear],
    model_dir: str | Path,
    dtype: torch.dtype,
    quantization: str,
) -> packed_cache.Packed | None:
    """The packed weights a store model kept from its last start (`packed_cache`), if they are
    one per projection, each of its shape: None if there are none or they do not fit."""
    kept = packed_cache.load(packed_cache.cache_file(model_dir, dtype, quantization))
    if kept is not None and _fits(kept, linears, model.head_weight):
        return kept
    return None


def _packed_weights(
    model: nn.Module,
    linears: dict[str, Linear],
    kept: packed_cache.Packed | None,
    model_dir: str | Path,
    dtype: torch.dtype,
    quantization: str,
    kernel: QuantMatmul,
    keep: bool = True,
) -> int:
    """Give the projections their int4 copies and the head its exact Q8_0 copy (a Q4_1 GGUF's
    head is Q8_0, llama.cpp's convention) for servelm's C kernel: the `kept` ones, else made
    from the loaded weights and (with `keep`) kept for the next start. Returns how many
    projections got one."""
    if kept is not None:
        for name, module in linears.items():
            packed, error = kept[name]
            module.use_int4(Int4Weight.from_packed(packed, module.out_features, error, kernel))
        if packed_cache.HEAD in kept:
            head = kept[packed_cache.HEAD][0]
            model.head_q8 = Q8Weight(head, model.head_weight.shape[0], kernel)
        model.int4_kept = True
        return len(linears)
    made = quantize_linears_int4(linears.values(), dtype, quantization == "auto", kernel)
    if made:
        model.head_q8 = Q8Weight.exact(model.head_weight, kernel)
        kept_now = {name: (m.int4.packed, m.int4.error) for name, m in linears.items()}
        if model.head_q8 is not None:
            kept_now[packed_cache.HEAD] = (model.head_q8.packed, 0.0)
        if keep:
            packed_cache.save(packed_cache.cache_file(model_dir, dtype, quantization), kept_now)
    return made


def _fits(kept: packed_cache.Packed, linears: dict[str, Linear], head: torch.Tensor) -> bool:
    """Whether kept weights are one per projection, each of its shape's blocks."""
    if set(kept) - {packed_cache.HEAD} != set(linears):
        return False
    shapes = [(kept[name][0], m.out_features, m.in_features) for name, m in linears.items()]
    if packed_cache.HEAD in kept:
        shapes.append((kept[packed_cache.HEAD][0], *head.shape))
    return all(p.shape[:2] == (rows // LANES, cols // GROUP) for p, rows, cols in shapes)


def gguf_blocks(model_dir: str | Path) -> dict[str, tuple[int, torch.Tensor]]:
    """The GGUF blocks an import kept (`GGUF_BLOCKS_FILE`): checkpoint name -> (GGUF type
    number, uint8 [rows, row bytes]); empty for a folder without them."""
    path = Path(model_dir) / GGUF_BLOCKS_FILE
    if not path.is_file():
        return {}
    number = {name: qtype for qtype, name in GGUF_KERNEL_TYPES.items()}
    with _open_checkpoint(path) as f:
        types = json.loads(f.metadata()["types"])
        return {n: (number[types[n]], f.get_tensor(n).clone()) for n in f.keys()}


def _checkpoint_parts(model: nn.Module, name: str, module: Linear) -> list[tuple[int, int, str]]:
    """(first row, rows, checkpoint tensor) for each tensor a projection's rows come from."""
    ckpt = model.checkpoint_name(f"{name}.weight")
    shards = getattr(module, "shards", None)
    parts = [
        (*shards.offsets[shard], ckpt.replace(f".{frag}.", f".{src}."))
        for src, (frag, shard) in getattr(model, "packed_modules", {}).items()
        if f".{frag}." in ckpt and shards is not None
    ]
    return sorted(parts) if parts else [(0, module.out_features, ckpt)]


def _exact_part(
    weight: torch.Tensor, name: str, blocks: dict, kernel: QuantMatmul
) -> tuple[str, object] | None:
    """The form of a float32 part of a projection's weight that holds exactly its values: the
    file's blocks (checked against the weight: the same file's dequantization), Q8_0's q8
    layout, Q4_1's q4 layout; None if none does."""
    rows, cols = weight.shape
    if name in blocks:
        qtype, raw = blocks[name]
        if GGUF_KERNEL_TYPES[qtype] == "Q8_0" and kernel.takes(rows, cols):
            made = kernel.quantize_q8(weight)  # the head's kernel: faster than the blocks'
            if made is not None and made[1] <= INT4_LOSSLESS_STEPS:
                return "q8", made[0]
        if raw.shape[0] == rows and torch.equal(kernel.gguf_dequantize(raw, qtype), weight):
            return "gguf", (qtype, raw)
        return None
    if kernel.takes(rows, cols):  # a Q4_1 part (not kept as blocks: q4 recovers it)
        made = kernel.quantize_q4(weight)
        if made is not None and made[1] <= INT4_LOSSLESS_STEPS:
            return "q4", made[0]
    return None


def _gguf_weights(
    model: nn.Module, blocks: dict, kernel: QuantMatmul
) -> tuple[int, dict[str, list[str]]]:
    """Give each projection whose every part is exactly a quantized form (`_exact_part`) a
    `GGUFWeight`; the others keep their (bf16) weights. Returns how many got one, and the
    checkpoint tensors by the form they are served in ("bf16" for the dequantized)."""
    served: dict[str, list[str]] = {}
    made = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":  # (the head: LogitsHead's)
            continue
        parts, forms = [], []
        for start, rows, ckpt in _checkpoint_parts(model, name, module):
            form = _exact_part(module.weight.data[start : start + rows], ckpt, blocks, kernel)
            forms.append(ckpt)
            parts.append(None if form is None else (start, rows, *form))
        if None in parts:
            served.setdefault("bf16", []).extend(forms)
            continue
        weight = GGUFWeight(parts, kernel)
        for ckpt, kind in zip(forms, weight.kinds(), strict=True):
            served.setdefault(kind, []).append(ckpt)
        module.use_quant(weight)
        made += 1
    return made, served


def _gguf_head(
    model_dir: str | Path, model: nn.Module, blocks: dict, kernel: QuantMatmul
) -> GGUFHead | None:
    """The logits head as the file's own blocks (the embedding's where the head shares it),
    where they hold exactly the checkpoint's head (read again from the file, in float32)."""
    name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    if name not in blocks:
        return None
    qtype, raw = blocks[name]
    for path in safetensors_files(model_dir):
        with _open_checkpoint(path) as f:
            if name not in f.keys():
                continue
            want = f.get_tensor(name)
            if raw.shape[0] == want.shape[0] and torch.equal(
                kernel.gguf_dequantize(raw, qtype), want
            ):
                logger.info(
                    "GGUF weights kept as %s: the logits head (%s)", GGUF_KERNEL_TYPES[qtype], name
                )
                return GGUFHead(raw, qtype, kernel)
    return None


def _names_by_layer(names: list[str]) -> str:
    """model.layers.{0,1}.mlp.down_proj.weight, ...: the names with their layer numbers merged."""
    merged: dict[str, list[str]] = {}
    for name in names:
        match = re.fullmatch(r"(.*\.layers\.)(\d+)(\..*)", name)
        key = f"{match.group(1)}{{}}{match.group(3)}" if match else name
        merged.setdefault(key, []).append(match.group(2) if match else "")
    return ", ".join(
        key.format("{" + ",".join(layers) + "}") if "{}" in key else key
        for key, layers in merged.items()
    )


def _return_freed_memory() -> None:
    """Hand the memory freed while loading (float32 copies, unpacked weights) back to the OS.
    glibc keeps freed heap memory for reuse, and it would count as the engine's RSS for the
    life of the process: 190 MiB on the default model with int4 copies."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to do
        return
    libc.malloc_trim(0)


def build_model(
    model_dir: str | Path,
    spec,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str = "none",
    quant_kernel: QuantMatmul | None = None,
    tp: TPGroup | None = None,
):
    """Construct the model without initialising weights, then fill it from the checkpoint.

    `quantization`: "none"; "int4", every projection the CPU int4 kernel takes also gets a
    4-bit copy (rounded to the nearest: lossy unless the weights are 4-bit already); "auto",
    int4 only where that loses nothing, i.e. the checkpoint's projection weights are 4-bit.
    The model's `int4_layers` says how many projections got one; `quant_kernel` (servelm's C
    `QuantMatmul`, or None for torch's kernel) is the code that multiplies by them, and by an
    exact Q8_0 copy of the logits head where the checkpoint's head is one.

    `tp`: this process is one rank of a tensor-parallel group; the model is its share
    (`model/parallel.py`), read from the checkpoint's slices alone. Its packed int4 copies are
    made at each start (the store keeps one model's, not each rank's).
    """
    from servelm.model.layers.rotary import RotaryEmbedding
    from servelm.model.registry import model_class

    if quantization == "int4" and (device.type, dtype) != ("cpu", torch.bfloat16):
        raise ValueError(
            f"--quantization int4 needs the CPU and bfloat16 (got {device}, "
            f"{str(dtype).replace('torch.', '')})"
        )
    # A GGUF import whose projections are K-quants or Q8_0 (it kept their blocks): each
    # projection is served from the file's own values where they are exactly its weights.
    blocks = gguf_blocks(model_dir) if quantization == "auto" and device.type == "cpu" else {}
    why_not = (
        "servelm's C kernel serves them as they are only in bfloat16 on a CPU where it is built"
        if quant_kernel is None or dtype != torch.bfloat16
        else "their blocks are not split across tensor-parallel ranks"
        if tp is not None
        else None
    )
    if blocks and why_not:
        logger.info(
            "GGUF quantized weights in %s dequantized to %s: %s",
            model_dir,
            str(dtype).replace("torch.", ""),
            why_not,
        )
        blocks = {}
    slicer = TPSlicer(spec, tp) if tp is not None else None
    projections = any(name.endswith("proj.weight") for name in blocks)
    int4 = not projections and (
        quantization == "int4"
        or (
            quantization == "auto"
            and device.type == "cpu"
            and _checkpoint_is_4bit(model_dir, dtype, slicer)
        )
    )

    # The rotary table is computed (in float32, stored in the model dtype), not loaded.
    rope = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling, dtype)
    # Parameters are made on the meta device (no memory, no initialisation), given their
    # dtype there, then allocated once on the device and filled from the checkpoint.
    local = rank_spec(spec, tp) if tp is not None else spec
    with torch.device("meta"):
        model = model_class(spec)(local, max_positions, rope)
    linears = int4_linears(model, dtype, device) if int4 else {}
    kept = None
    if int4 and quant_kernel is not None and tp is None:
        kept = _kept_weights(model, linears, model_dir, dtype, quantization)
    # Int4 and int8 copies made now are made from the checkpoint's own values, so matmul weights
    # then load in float32 first and take the model's dtype afterwards. Kept copies that the C
    # kernel serves at every row leave the projections' plain weights unread (`use_int4` frees
    # them): those are neither allocated nor loaded, which shortens a start (docs/performance.md).
    skip = frozenset()
    if kept is not None and StepPaths.of(quant_kernel).int4_max_rows == ALL_ROWS:
        skip = frozenset(f"{name}.weight" for name in linears)
    _allocate_parameters(
        model,
        dtype,
        device,
        torch.float32 if (int4 and kept is None) or projections else dtype,
        skip,
    )
    model.rope = rope.to(device)
    load_weights(model, model_dir, skip, slicer)
    model.int4_layers = 0
    model.int4_kept = False  # whether the int4 copies were read from the store (packed_cache)
    model.gguf_layers = 0  # projections served from a GGUF file's own quantized values
    if projections:
        model.gguf_layers, served = _gguf_weights(model, blocks, quant_kernel)
        model.head_q8 = Q8Weight.exact(model.head_weight, quant_kernel)  # float32 still
        for form in sorted(served):
            verb = "dequantized to" if form == "bf16" else "kept as"
            logger.info(
                "GGUF weights %s %s (%d tensors): %s",
                verb,
                form,
                len(served[form]),
                _names_by_layer(served[form]),
            )
        model.to(dtype)
    if int4:
        if quant_kernel is not None:
            model.int4_layers = _packed_weights(
                model, linears, kept, model_dir, dtype, quantization, quant_kernel, tp is None
            )
        else:
            model.int4_layers = quantize_linears_int4(
                linears.values(), dtype, quantization == "auto"
            )
        model.to(dtype)
    if blocks and model.head_q8 is None:  # a head the q8 kernel does not take exactly
        model.head_q8 = _gguf_head(model_dir, model, blocks, quant_kernel)
    # Counted before repacking, which frees the plain copies of packed weights.
    quantized = [m.int4 for m in model.modules() if isinstance(m, Linear) and m.int4 is not None]
    quantized += [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    quantized += [model.head_q8] if model.head_q8 is not None else []
    model.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        w.nbytes for w in quantized
    )
    model.batch_invariant = quant_kernel is not None and quant_kernel.invariant
    model.prepare_for_inference()
    if tp is not None:
        apply_tp(model, tp, spec.vocab_size)
    model.bytes_read = slicer.bytes_read if slicer is not None else None
    if device.type == "cpu":
        _return_freed_memory()
    return model.eval()
