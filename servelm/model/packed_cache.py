"""A store model's quantized matmul weights, packed for servelm's C kernel, kept between starts.

Making them is most of loading the default model: rounding 120 projections to their Q4_1 grid
and the head to Q8_0, then packing both into the kernel's layout (times in
docs/performance.md). A model in servelm's store keeps them in its folder, under `.packed/`, in
one safetensors file named by a key of all they depend on: the model's files (name, size,
modification time), the kernel's sources (its layout), the dtype and the quantization mode. The
next start of the same model reads that file instead. Anything else (another key, a file that
does not read, a folder outside the store) makes them again, as before; a failure to write the
file costs nothing but the next start's time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from servelm.store.paths import PACKED_FOLDER, default_store_dir

logger = logging.getLogger(__name__)

FOLDER = PACKED_FOLDER
_KERNEL_SOURCES = [
    Path(__file__).parent.parent / "kernels" / name
    for name in ("quant_matmul.c", "quant_matmul.py", "common.h")
]

# module name (or HEAD) -> (packed bytes, grid error in steps)
Packed = dict[str, tuple[torch.Tensor, float]]
HEAD = "head_q8"


def cache_file(model_dir: str | Path, dtype: torch.dtype, quantization: str) -> Path | None:
    """Where this model's packed weights live, or None for a folder outside the store."""
    folder = Path(model_dir).resolve()
    if not folder.is_relative_to(default_store_dir().resolve()):
        return None
    h = hashlib.sha256(f"{dtype} {quantization}".encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = path.stat()
        h.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    for source in _KERNEL_SOURCES:
        h.update(source.read_bytes())
    return folder / FOLDER / f"{h.hexdigest()[:24]}.safetensors"


def load(path: Path | None) -> Packed | None:
    """The packed weights saved at `path`, or None (no such file, or one that does not read)."""
    if path is None or not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            errors = json.loads(f.metadata()["errors"])
            # cloned: the kernel's memory, aligned as torch aligns it, not a view of the file
            return {name: (f.get_tensor(name).clone(), float(errors[name])) for name in f.keys()}
    except Exception as exc:  # a torn or foreign file: make them again
        logger.warning("ignoring packed weights in %s: %s", path, exc)
        return None


def save(path: Path | None, packed: Packed) -> None:
    """Write `packed` to `path` (replacing any other key's file of the model), if it can."""
    if path is None or not packed:
        return
    try:
        path.parent.mkdir(exist_ok=True)
        for old in path.parent.glob("*.safetensors"):
            if old.name != path.name:  # another key's: the model's files or kernel changed
                old.unlink(missing_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")  # one per writer
        errors = {name: error for name, (_, error) in packed.items()}
        tensors = {name: tensor.contiguous() for name, (tensor, _) in packed.items()}
        save_file(tensors, str(partial), metadata={"errors": json.dumps(errors)})
        partial.chmod(0o644)  # safetensors makes it owner-only; read like the model's own files
        partial.replace(path)  # readers see the whole file or none
    except OSError as exc:
        logger.warning("could not keep the packed weights in %s: %s", path.parent, exc)
