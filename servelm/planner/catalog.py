"""Catalogs the planner sizes against: known model shapes and GPU datasheet numbers.

Model shapes are copied from each model's published config.json (the `hf_id` names
which one); parameter counts come from `ModelShape.num_params()`, not from the model
card. Context lengths are the native `max_position_embeddings` (no RoPE scaling).

GPU numbers are datasheet peaks, decimal units throughout: memory in GB = 1e9 bytes
(the nominal "80 GB" of an H100 is counted as 80e9 bytes, the convention the sizing
worked examples use; the device really exposes ~81,559 MiB, so plans err a little on
the safe side), bandwidth in bytes/s, FLOP/s dense (the datasheets' "with sparsity"
figures are twice these). `fp8_flops` is None where the tensor cores have no fp8.
`link_bandwidth` is half the datasheet's bidirectional NVLink figure (H100/H200 900 GB/s,
A100 600 GB/s, B200 1.8 TB/s); PCIe-only cards get a sustained PCIe Gen4 x16 rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servelm.planner.shapes import ModelShape, ShapeError, shape_from_folder

GB = 1e9
TB = 1e12
PCIE_LINK = 25 * GB  # cards without NVLink talk over PCIe Gen4 x16 (~25 GB/s sustained)


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator's datasheet numbers (decimal units, dense FLOP/s)."""

    name: str
    memory_bytes: float
    mem_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None = None
    link_bandwidth: float = PCIE_LINK  # GPU-to-GPU bytes/s, one direction (NVLink or PCIe)

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense tensor-core peak for matmuls in `dtype` (fp8 falls back to bf16 if absent)."""
        if dtype == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


GPUS: dict[str, GpuSpec] = {
    "h100-80gb": GpuSpec("H100 80GB SXM", 80 * GB, 3.35 * TB, 989.4e12, 1978.9e12, 450 * GB),
    "h200-141gb": GpuSpec("H200 141GB SXM", 141 * GB, 4.8 * TB, 989.4e12, 1978.9e12, 450 * GB),
    "a100-40gb": GpuSpec("A100 40GB SXM", 40 * GB, 1.555 * TB, 312e12, None, 300 * GB),
    "a100-80gb": GpuSpec("A100 80GB SXM", 80 * GB, 2.039 * TB, 312e12, None, 300 * GB),
    "l4": GpuSpec("L4 24GB", 24 * GB, 0.3 * TB, 121e12, 242e12),
    # AWS's variant of the A10 (A10: 125 TFLOP/s); same 24 GB and 600 GB/s.
    "a10g": GpuSpec("A10G 24GB", 24 * GB, 0.6 * TB, 70e12),
    # Ada whitepaper: bf16 / fp8 with fp32 accumulate.
    "rtx-4090": GpuSpec("RTX 4090 24GB", 24 * GB, 1.008 * TB, 165.2e12, 330.3e12),
    # HGX/DGX B200 expose 180 GB of the announced 192 GB.
    "b200": GpuSpec("B200 180GB", 180 * GB, 8 * TB, 2250e12, 4500e12, 900 * GB),
}

_GPU_ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb", "4090": "rtx-4090"}


def _llama(
    name: str,
    hf_id: str,
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv: int,
    tied: bool = False,
    head_dim: int = 128,
    vocab: int = 128256,
    ctx: int = 131072,
) -> ModelShape:
    return ModelShape(
        name, layers, hidden, inter, heads, kv, head_dim, vocab, tied, ctx, hf_id=hf_id
    )


def _qwen(
    name: str,
    hf_id: str,
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv: int,
    tied: bool = False,
    vocab: int = 152064,
) -> ModelShape:
    return ModelShape(
        name,
        layers,
        hidden,
        inter,
        heads,
        kv,
        hidden // heads,
        vocab,
        tied,
        32768,
        qkv_bias=True,
        hf_id=hf_id,
    )


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _llama("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 4096, 14336, 32, 8),
        _llama("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 80, 8192, 28672, 64, 8),
        _llama("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", 126, 16384, 53248, 128, 8),
        _llama(
            "llama-3.2-1b",
            "meta-llama/Llama-3.2-1B-Instruct",
            16,
            2048,
            8192,
            32,
            8,
            tied=True,
            head_dim=64,
        ),
        _llama(
            "llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", 28, 3072, 8192, 24, 8, tied=True
        ),
        _qwen("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", 24, 896, 4864, 14, 2, True, 151936),
        _qwen("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", 28, 1536, 8960, 12, 2, True, 151936),
        _qwen("qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct", 36, 2048, 11008, 16, 2, True, 151936),
        _qwen("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 28, 3584, 18944, 28, 4),
        _qwen("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", 48, 5120, 13824, 40, 8),
        _qwen("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", 64, 5120, 27648, 40, 8),
        _qwen("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", 80, 8192, 29568, 64, 8),
        _llama(
            "mistral-7b",
            "mistralai/Mistral-7B-Instruct-v0.3",
            32,
            4096,
            14336,
            32,
            8,
            vocab=32768,
            ctx=32768,
        ),
        _llama(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            30,
            576,
            1536,
            9,
            3,
            tied=True,
            head_dim=64,
            vocab=49152,
            ctx=8192,
        ),
        # Qwen3: q/k norms, head_dim 128 apart from hidden / heads, no q/k/v bias.
        ModelShape(
            "qwen3-0.6b",
            28,
            1024,
            3072,
            16,
            8,
            128,
            151936,
            True,
            40960,
            hf_id="Qwen/Qwen3-0.6B",
            qk_norm=True,
        ),
        ModelShape(
            "qwen3-8b",
            36,
            4096,
            12288,
            32,
            8,
            128,
            151936,
            False,
            40960,
            hf_id="Qwen/Qwen3-8B",
            qk_norm=True,
        ),
        # Gemma: four norms a layer, tied embeddings; half (Gemma 2) or five in six (Gemma 3)
        # of the layers windowed, but the global ones keep every block, so the KV math is the
        # full-context one (kv_window 0).
        ModelShape(
            "gemma-2-2b",
            26,
            2304,
            9216,
            8,
            4,
            256,
            256000,
            True,
            8192,
            hf_id="google/gemma-2-2b-it",
            post_norms=True,
        ),
        ModelShape(
            "gemma-2-9b",
            42,
            3584,
            14336,
            16,
            8,
            256,
            256000,
            True,
            8192,
            hf_id="google/gemma-2-9b-it",
            post_norms=True,
        ),
        ModelShape(
            "gemma-3-1b",
            26,
            1152,
            6912,
            4,
            1,
            256,
            262144,
            True,
            32768,
            hf_id="google/gemma-3-1b-it",
            qk_norm=True,
            post_norms=True,
        ),
        # Phi-3.5-mini: q/k/v and gate/up fused in the checkpoint (the same parameters), LongRoPE
        # to 128k; its sliding_window (262,144) lies beyond its context.
        ModelShape(
            "phi-3.5-mini",
            32,
            3072,
            8192,
            32,
            32,
            96,
            32064,
            False,
            131072,
            hf_id="microsoft/Phi-3.5-mini-instruct",
        ),
        # Mixtures of experts: every expert counts in the weights, experts_per_tok in compute.
        ModelShape(
            "mixtral-8x7b",
            32,
            4096,
            14336,
            32,
            8,
            128,
            32000,
            False,
            32768,
            hf_id="mistralai/Mixtral-8x7B-Instruct-v0.1",
            num_experts=8,
            experts_per_tok=2,
            moe_intermediate_size=14336,
        ),
        ModelShape(
            "qwen3-30b-a3b",
            48,
            2048,
            6144,  # the dense width no layer uses (mlp_only_layers is empty)
            32,
            4,
            128,
            151936,
            False,
            40960,
            hf_id="Qwen/Qwen3-30B-A3B",
            qk_norm=True,
            num_experts=128,
            experts_per_tok=8,
            moe_intermediate_size=768,
        ),
    )
}


def _normalise(name: str) -> str:
    name = name.lower().rsplit("/", 1)[-1].replace("meta-llama-", "llama-")
    for suffix in ("-instruct-v0.3", "-instruct-v0.1", "-instruct", "-v0.3", "-v0.1", "-it"):
        name = name.removesuffix(suffix)
    return name


def get_model(name: str) -> ModelShape:
    """Look up a catalog model by key or hub id ("llama-3.1-8b", "Qwen/Qwen2.5-7B-Instruct").

    A hub id is matched by its name (a base model's id finds its instruct model's shape, the
    same one), but only under the owner of the catalog entry's `hf_id`: another owner's repo
    of that name may hold any model, and the planner reads no hub to know which."""
    shape = MODELS.get(_normalise(name))
    owner = name.rsplit("/", 1)[0] if "/" in name else None
    if shape is not None and owner is not None and shape.hf_id:
        catalog_owner = shape.hf_id.split("/", 1)[0]
        if owner.lower() != catalog_owner.lower():
            raise ShapeError(
                f"unknown model {name!r}: the catalog's {shape.name} is {catalog_owner}'s "
                f"({shape.hf_id}); for another repository, pass a folder with its config.json "
                f"(`servelm fetch {name}` prints one)"
            )
    if shape is None:
        fetch = f": `servelm fetch {name}` prints one" if owner is not None else ""
        raise ShapeError(
            f"unknown model {name!r}; known: {', '.join(MODELS)} (or a folder with "
            f"config.json{fetch})"
        )
    return shape


def resolve_model(name_or_folder: str) -> ModelShape:
    """A local folder (or config.json path) if one exists, else a catalog entry."""
    path = Path(name_or_folder).expanduser()
    if path.is_dir() or path.name == "config.json":
        return shape_from_folder(path)
    return get_model(name_or_folder)


def get_gpu(name: str) -> GpuSpec:
    """Look up a catalog GPU by key ("h100-80gb") or short alias ("h100")."""
    key = name.lower()
    spec = GPUS.get(_GPU_ALIASES.get(key, key))
    if spec is None:
        raise ShapeError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return spec
