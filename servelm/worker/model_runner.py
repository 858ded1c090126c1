"""ModelRunner: owns the model and its KV cache on one device; runs one step of the scheduler.

`execute` turns a `SchedulerOutput` into flat tensors (token ids, positions, slot mapping,
block tables), runs one forward over the mixed batch and samples one token for every request
whose prompt is complete. A request with prompt_logprobs has every row of its prompt chunk
computed through the last layer and scored (`sampler.prompt_logprobs`); the others keep only
the rows they sample from. Per-request state kept here is only the seeded random generator.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servelm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from servelm.kernels.build import build_all
from servelm.kernels.cpu_ops import CpuOps
from servelm.kernels.paged_decode import PagedDecodeKernel
from servelm.kernels.paged_prefill import PagedPrefillKernel
from servelm.kernels.paths import ALL_ROWS, StepPaths
from servelm.kernels.quant_matmul import GGUF_KERNEL_TYPES, QuantMatmul
from servelm.model.config import ModelSpec
from servelm.model.loader import build_model
from servelm.model.parallel import TPGroup, rank_spec
from servelm.worker.attention import TorchPagedAttention
from servelm.worker.decode_stack import DecodeStack
from servelm.worker.kv_pool import PageFiller, kv_pool
from servelm.worker.sampler import SamplingBatch, prompt_logprobs, sample

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        cause = (
            "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        )
        raise ValueError(f"--device {name}: {cause}; use --device cpu or auto")
    return device


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = spec.torch_dtype if spec.torch_dtype in _DTYPES else "float32"
        if device.type == "cpu" and name == "float16":
            name = "bfloat16"  # CPU float16 matmuls are slow and rarely accurate enough
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_block: int


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        spec: ModelSpec,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str = "auto",
        kernels: str = "auto",
        int4_activations: str = "auto",
        batch_invariant: bool = True,
        block_size: int = 16,
        max_model_len: int,
        seed: int = 0,
        num_threads: int | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        # Under tensor parallelism the runner holds rank `tp.rank`'s share: its heads (and KV
        # cache), MLP width and vocabulary (`model/parallel.py`).
        self.tp = tp
        self.spec = rank_spec(spec, tp) if tp is not None else spec
        self.device = resolve_device(device)
        if tp is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
        self.dtype = resolve_dtype(dtype, spec, self.device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        if kernels not in ("auto", "torch"):
            raise ValueError(f"unknown kernels {kernels!r}; choose auto, torch")
        self.use_c_kernels = kernels == "auto" and self.device.type == "cpu"
        torch.manual_seed(seed)
        if self.device.type == "cpu":
            # Every core: a decode step is bound by reading the weights, which both cores do
            # faster together. The engine process bounds OpenMP's spinning so that sharing the
            # cores with the API process does not stall it (core_process.bound_openmp_spin).
            torch.set_num_threads(num_threads or os.cpu_count() or 1)
        if self.use_c_kernels:
            t0 = time.perf_counter()
            build_all()  # side by side, before any is loaded: a first start compiles them
            if time.perf_counter() - t0 > 0.5:
                logger.info("C kernels built in %.2f s", time.perf_counter() - t0)
        self.quant_kernel = QuantMatmul.load() if self.use_c_kernels else None
        if self.quant_kernel is not None:
            self.quant_kernel.use_activations(int4_activations)
            self.quant_kernel.batch_invariant(batch_invariant)
        self.batch_invariant = batch_invariant
        t0 = time.perf_counter()
        self.model = build_model(
            model_dir,
            spec,
            self.dtype,
            self.device,
            max_model_len,
            quantization,
            self.quant_kernel,
            tp,
        )
        self.weight_bytes = self.model.weight_bytes
        self.int4_layers = self.model.int4_layers
        self.load_seconds = time.perf_counter() - t0
        self.model.use_cpu_ops(CpuOps.load() if self.use_c_kernels else None)
        self.attn: TorchPagedAttention | None = None
        self.decode_stack: DecodeStack | None = None  # set with the KV cache
        self.kv_pages: PageFiller | None = None  # the thread mapping the pool's pages, if any
        self.generators: dict[str, torch.Generator] = {}

    # -- KV cache -------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.spec.kv_bytes_per_token(itemsize) * self.block_size

    def profile_num_blocks(
        self,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float,
        max_num_batched_tokens: int,
    ) -> int:
        """How many blocks the KV budget buys: bytes given, or (CUDA) what a profiling run leaves."""
        if kv_cache_memory is None and self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._dummy_forward(max_num_batched_tokens)
            peak = torch.cuda.max_memory_allocated(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            kv_cache_memory = int(total * gpu_memory_utilization - peak)
            logger.info("profiling: peak %.2f GiB of %.2f GiB", peak / 2**30, total / 2**30)
        if kv_cache_memory is None:
            kv_cache_memory = 1 << 30
        return max(0, kv_cache_memory // self.bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks * self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        # One mapping for every layer's K and V.
        pool, self.kv_pages = kv_pool((self.spec.num_layers, 2, *shape), self.dtype, self.device)
        caches = [(layer[0], layer[1]) for layer in pool]
        decode = prefill = None
        if self.use_c_kernels:
            decode = PagedDecodeKernel.load(self.dtype, self.spec.head_dim)
            prefill = PagedPrefillKernel.load(self.dtype, self.spec.head_dim, self.block_size)
        self.attn = TorchPagedAttention.for_model(
            self.spec, caches, self.block_size, decode, prefill, self.batch_invariant
        )
        self.decode_stack = DecodeStack.build(self.model, self.attn)
        self.num_blocks = num_blocks

    @property
    def decode_stack_max_tokens(self) -> int:
        """Steps of up to this many tokens run on the decode stack: decode-only ones, or every
        kind where it takes prompts (0: none do)."""
        return self.decode_stack.max_rows if self.decode_stack is not None else 0

    @property
    def wide_step_min_tokens(self) -> int:
        """Steps of at least this many tokens run their int4 matmuls through float32 copies of
        the weights and torch's float32 matmul (`QuantMatmul.sgemm_min_rows`; 0: none do)."""
        paths = self.paths
        if not (self.int4_layers and paths.sgemm_min_rows):
            return 0
        # (where the int4 weights stop short of it, such steps never reach the C kernel)
        return paths.sgemm_min_rows if paths.int4_max_rows >= paths.sgemm_min_rows else 0

    @property
    def paths(self) -> StepPaths:
        """Which path each part of a step takes here (`kernels/paths.py`)."""
        return StepPaths.of(self.quant_kernel)

    @property
    def step_paths(self) -> dict[str, int]:
        """What a step-time model must know of this engine's code paths (`sim.roofline`)."""
        return {
            "decode_stack_max_tokens": self.decode_stack_max_tokens,
            "wide_step_min_tokens": self.wide_step_min_tokens,
        }

    @property
    def torch_projections(self) -> int:
        """Projections some of whose inputs go to torch's matmul (a bfloat16 or float32 weight
        with no 4-bit or GGUF copy in C for every row count): oneDNN and MKL pick their paths
        by the row count, so steps through them are not batch invariant. Multiplying them in
        fixed row chunks, as the logits head does, would be; not done (docs/architecture.md)."""
        from servelm.model.layers.linear import Linear
        from servelm.model.moe import Router

        def in_c(copy) -> bool:
            return copy is not None and copy.kernel is not None and copy.max_rows == ALL_ROWS

        # (an MoE layer's router too: it stays out of `Linear`, and so in torch, so that int4
        # rounding never moves a token to another expert)
        return sum(
            1
            for m in self.model.modules()
            if isinstance(m, Router)
            or (isinstance(m, Linear) and not (in_c(m.quant) or in_c(m.int4)))
        )

    @property
    def kernel_summary(self) -> str:
        """Which code runs attention (decode, prefill), the element-wise layers and the
        quantized matmuls."""
        decode = self.attn.decode_kernel if self.attn else None
        prefill = self.attn.prefill_kernel if self.attn else None
        attention = f"C {decode.name}" if decode else "torch SDPA over gathered blocks"
        prefill_attention = f"C {prefill.name}" if prefill else "torch SDPA"
        if self.attn and self.attn.decodes_as_chunks:  # batch invariant: one path for both
            attention = f"C {prefill.name}, as prompt tokens are"
        layers = "C cpu_ops" if self.model.cpu_ops else "torch ops"
        summary = f"{self.paths.summary()}; decode attention: {attention}"
        torch_matmuls = self.torch_projections
        if self.paths.invariant and torch_matmuls:  # (the kernels are; these layers are not)
            summary = summary.replace(
                "batch invariant",
                f"batch invariant but for {torch_matmuls} projections in torch (bfloat16 or "
                "float32 weights: its paths depend on the row count)",
                1,
            )
        summary += f"; prefill attention: {prefill_attention}; norm, rotary, SiLU: {layers}"
        if self.int4_layers:  # (which rows, and how: the paths' summary above)
            int4 = "C q4_matmul" if self.quant_kernel else "torch _weight_int4pack_mm"
            summary += f"; int4 projections: {int4}"
        head = self.model.head_q8
        if head is not None:  # a Q8Weight, or a GGUFHead with the file's own blocks
            qtype = getattr(head, "qtype", None)
            kernel = (
                "q8_matmul (Q8_0)" if qtype is None else f"gguf_matmul ({GGUF_KERNEL_TYPES[qtype]})"
            )
            summary += f"; logits head: C {kernel}"
        if self.decode_stack is not None:
            rows = self.decode_stack_max_tokens
            steps = "decode steps" if rows == ALL_ROWS else f"decode steps of <= {rows} tokens"
            if self.decode_stack.takes_prompts:
                steps = "every step" if rows == ALL_ROWS else f"steps of <= {rows} tokens"
            summary += f"; {steps}: all layers in one C call"
        return summary

    def _dummy_forward(self, num_tokens: int) -> None:
        """A forward without a KV cache of its own: writes into a throwaway single block."""
        num_tokens = max(1, min(num_tokens, self.max_model_len))
        scratch = [
            (
                torch.zeros(
                    num_tokens + self.block_size,
                    self.spec.num_kv_heads,
                    self.spec.head_dim,
                    dtype=self.dtype,
                    device=self.device,
                ),
            )
            * 2
            for _ in range(self.spec.num_layers)
        ]
        attn = TorchPagedAttention.for_model(self.spec, scratch, self.block_size)
        blocks = list(range(-(-num_tokens // self.block_size)))
        attn.plan([(0, num_tokens, blocks)], self.device, self.dtype)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        with torch.inference_mode():
            self.model.compute_logits(self.model(ids, pos, attn)[-1:])

    def warm_up(self, max_num_batched_tokens: int) -> None:
        """Pays a first step's one-off costs before the first request does: thread pools and
        library set-up, and on a GPU also kernel selection and the allocator's pools for a
        full step. On the CPU one token does it: a larger warm-up only lengthens start-up
        (docs/performance.md)."""
        if self.device.type != "cpu":
            self._dummy_forward(min(max_num_batched_tokens, 256))
        self._dummy_forward(1)

    # -- one step -------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. The KV pool's pages are not mapped in the background meanwhile."""
        pages = self.kv_pages
        if pages is None:
            return self._execute(so)
        if pages.done.is_set():
            self.kv_pages = None
        with pages.held():
            return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_request_ids:
            self.generators.pop(rid, None)
        if not so.requests:
            return ModelRunnerOutput({})

        ids: list[int] = []
        positions: list[int] = []
        seqs = []
        for r in so.requests:
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            positions.extend(range(r.num_computed_tokens, r.num_computed_tokens + n))
            seqs.append((r.num_computed_tokens, n, r.block_ids))
        sampled = [r for r in so.requests if r.sample]
        keep_all = None  # per request: scores prompt positions in this step (all its rows kept)
        if any(r.sampling_params.prompt_logprobs is not None for r in so.requests):
            keep_all = [_scores_prompt(r) for r in so.requests]
            keep_all = keep_all if any(keep_all) else None

        device = self.device
        self.attn.plan(seqs, device, self.dtype, [r.sample for r in so.requests], keep_all)
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        with torch.inference_mode():
            # (the C layer loop keeps a chunk's last row only: a scoring step takes the layers)
            hidden = None if keep_all else self.decode_stack and self.decode_stack(input_ids, pos)
            if hidden is None:
                hidden = self.model(input_ids, pos, self.attn)
            scored = self._prompt_logprobs(hidden, so.requests, keep_all) if keep_all else {}
            if not sampled:
                return ModelRunnerOutput({}, prompt_logprobs=scored)
            if self.tp is not None and self.tp.rank:  # rank 0 samples; this one only gathers
                self.model.compute_logits(hidden[self.attn.meta.sample_rows])
                return ModelRunnerOutput({})
            # hidden holds the kept rows (attention.py): the sampled requests' places there
            logits = self.model.compute_logits(hidden[self.attn.meta.sample_rows])
            batch = SamplingBatch(
                sampled, [self._generator(r.request_id, r.sampling_params.seed) for r in sampled]
            )
            if so.grammar_bitmask is not None:
                row_of = {r.request_id: i for i, r in enumerate(sampled)}
                batch.grammar_rows = [row_of[rid] for rid in so.grammar_bitmask.request_ids]
                batch.grammar_bits = torch.from_numpy(so.grammar_bitmask.bits)
            tokens, lps = sample(logits, batch, self.model.cpu_ops)
        out = ModelRunnerOutput(
            {r.request_id: t for r, t in zip(sampled, tokens, strict=True)}, prompt_logprobs=scored
        )
        for r, lp in zip(sampled, lps, strict=True):
            if lp is not None:
                out.logprobs[r.request_id] = lp
        return out

    def _prompt_logprobs(self, hidden, requests, keep_all) -> dict[str, tuple[int, list]]:
        """Each scoring request's prompt logprobs for this step's positions: (first prompt
        token scored, entries), the rows where the next token is a prompt token."""
        places = self.attn.meta.all_rows_places
        out = {}
        for i, r in enumerate(requests):
            if not keep_all[i]:
                continue
            start = r.num_computed_tokens
            rows = min(len(r.token_ids), len(r.prompt_token_ids) - 1 - start)
            first = places[i]
            targets = r.prompt_token_ids[start + 1 : start + 1 + rows]
            k = r.sampling_params.prompt_logprobs
            entries = prompt_logprobs(
                self.model.compute_logits, hidden[first : first + rows], targets, k
            )
            out[r.request_id] = (start + 1, entries)
        return out

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed32(seed))
            self.generators[request_id] = gen
        return gen


def seed32(seed: int) -> int:
    """A request's seed as a generator takes it. torch's CPU generator (mt19937) keeps only a
    seed's low 32 bits, so seeds 1 and 2**32 + 1 drew the same tokens; a seed outside
    [0, 2**32) is mixed down (SplitMix64's finalizer) so that each of its 64 bits counts. The
    seeds people type keep the draws they had."""
    if 0 <= seed < 1 << 32:
        return seed
    z = seed & (1 << 64) - 1
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & (1 << 64) - 1
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & (1 << 64) - 1
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def _scores_prompt(r) -> bool:
    """Whether this step of `r` holds prompt positions to score: one whose next token is in
    the prompt (the last prompt position predicts the first generated token instead)."""
    return (
        r.sampling_params.prompt_logprobs is not None
        and r.num_computed_tokens < len(r.prompt_token_ids) - 1
    )
