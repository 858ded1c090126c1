"""EngineArgs: every knob of the engine, its command-line flags, and their defaults."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

_SIZE = re.compile(r"^\s*([\d.]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


# On a CPU, new prompts join a step only while its prompt tokens are fewer than this. A CPU's
# prompt step costs about the same per token from a few dozen rows on, so batching more prompts
# buys no speed, and each of them would get its first token when the last one does. (A GPU
# batches prompts nearly free: no cap there.)
CPU_PREFILL_ADMIT_TOKENS = 512

# The least each scheduler limit may be: below it no request would ever be scheduled (the
# command lines' types and SchedulerConfig both hold to it)
SCHEDULER_LEAST = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_prefill_admit_tokens": 0}


def bounded_int(least: int, most: int | None = None, error: str = "not an integer >= {least}"):
    """An argparse type: an integer from `least` to `most` (None: no upper bound); anything else
    is a usage error, `error` (formatted with least and most) followed by the text given. A
    scheduler limit below its least would admit nothing, and the server would hang instead of
    saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least or (most is not None and value > most):
            message = error.format(least=least, most=most)
            raise argparse.ArgumentTypeError(f"{message}: {text!r}")
        return value

    return parse


# A TCP port: 0 (any free one) to 65535
port_number = bounded_int(0, 65535, "not a port ({least}-{most})")

# The engine's sizes: 0 or less would fail only once the model has loaded (a block size of 0
# divides by it), or, for --max-model-len 0, quietly mean "the model's context"
positive_int = bounded_int(1)

# The devices the engine runs on. torch knows more names ("mps", "xpu"), but only fails on them,
# or on a typo, once the model is loading; whether this build has CUDA is for the engine to say
# (importing torch here would slow every command's start).
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_name(text: str) -> str:
    """The argparse type of --device."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a device (auto, cpu, cuda or cuda:N): {text!r}")
    return text


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1] (a share of the GPU's memory)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # fails the test below
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"not a number in (0, 1]: {text!r}")
    return value


def scheduler_limit(name: str):
    """The argparse type of a scheduler limit's flag (`SCHEDULER_LEAST`)."""
    return bounded_int(SCHEDULER_LEAST[name])


# What each of these engine arguments may be: the command line's choices, and what EngineArgs
# itself checks (`LLM(**kwargs)` skips argparse, and an unknown value would be taken for another
# or fail only once the model is loading)
ENGINE_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "quantization": ("auto", "none", "int4"),
    "kernels": ("auto", "torch"),
    "int4_activations": ("auto", "int16", "int8", "float32"),
    "scheduling_policy": ("fcfs", "priority"),
}

# The argparse types of the engine's other checked arguments: EngineArgs gives each value to
# the same function as text (so 3.5 or True is no integer)
ENGINE_TYPES = {
    "device": device_name,
    "max_model_len": positive_int,
    "block_size": positive_int,
    "gpu_memory_utilization": fraction,
    "num_threads": positive_int,
    "tensor_parallel_size": bounded_int(1, 64),
    **{name: scheduler_limit(name) for name in SCHEDULER_LEAST},
}


def parse_size(text: str | int | None) -> int | None:
    """'4GiB', '512MB', '1e9' or a number of bytes -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass
class EngineArgs:
    model: str | None = None  # folder, .gguf file or hub id; None = the embedded default
    store: str | None = None
    revision: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"  # auto: int4 projection weights where lossless (--quantization)
    device: str = "auto"
    kernels: str = "auto"  # auto: servelm's C kernels on the CPU where they build; torch
    int4_activations: str = "auto"  # how the C kernel's int4 matmuls take x
    batch_invariant: bool = True  # a request's greedy tokens the same whatever its step holds
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_admit_tokens: int | None = None  # None: by device (prefill_admit_tokens)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default 1 GiB on CPU, profiled on CUDA
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None = every core
    tensor_parallel_size: int = 1  # ranks one model is split over (worker/tp.py)
    step_trace: str | None = None  # append one JSON line per engine step to this file

    def __post_init__(self) -> None:
        """ValueError naming the first argument the command line would refuse."""
        for name, choices in ENGINE_CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
        optional = {f.name for f in fields(self) if f.default is None}
        for name, parse in ENGINE_TYPES.items():
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            try:
                setattr(self, name, parse(str(value)))
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{name}: {exc}") from None
        try:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"kv_cache_memory: {exc}") from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
        if model_positional:
            parser.add_argument(
                "model",
                nargs="?",
                default=None,
                help="model folder, .gguf file or hub id (default: SmolLM2-135M-Instruct)",
            )
        g = parser.add_argument_group("engine")
        g.add_argument("--store", default=None, help="model store folder (env SERVELM_MODEL_STORE)")
        g.add_argument("--revision", default=None, help="hub revision to pin")
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--dtype", default="auto", choices=ENGINE_CHOICES["dtype"])
        g.add_argument(
            "--quantization",
            default="auto",
            choices=ENGINE_CHOICES["quantization"],
            help="int4: the projections multiply 4-bit copies of their weights (CPU, "
            "bfloat16; lossy unless the weights are 4-bit already); auto: int4 only when "
            "lossless, as for a Q4_1 GGUF such as the default model",
        )
        g.add_argument(
            "--device",
            type=ENGINE_TYPES["device"],
            default="auto",
            help="auto, cpu, cuda, cuda:1 ...",
        )
        g.add_argument(
            "--kernels",
            default="auto",
            choices=ENGINE_CHOICES["kernels"],
            help="auto: on the CPU, attention, the fused norm / rotary / SiLU layers and the "
            "int4 / Q8_0 matmuls run in servelm's C kernels (built with the system C compiler "
            "on first use, then cached), and a step whose int4 matmuls stay in C runs all its "
            "layers in one C call (with --batch-invariant, every step); torch ops where they "
            "cannot be built. torch: torch ops only, as on CUDA",
        )
        g.add_argument(
            "--int4-activations",
            default="auto",
            choices=ENGINE_CHOICES["int4_activations"],
            help="how the C int4 matmuls take x (not on AMX tiles): int16 per group of 32 "
            "(exact but for x 2^7 below its group's largest), int8 as llama.cpp does (about "
            "0.7 %% off; with VNNI 1.5-1.6x faster prompts), float32 (x as it is: bfloat16 "
            "products with AVX-512 BF16); auto: int16 on CPUs without AVX-512 BF16, where it "
            "is faster, else float32. The Q8_0 logits head takes int16 under either integer "
            "width, but for AVX-512 BF16's own path, which is faster",
        )
        g.add_argument(
            "--batch-invariant",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="compute every token alike whatever else its step holds, so that greedy "
            "output is the same sent alone, in a batch, chunked, after a prefix-cache hit or "
            "after preemption (the C kernels on the CPU; default); --no-batch-invariant picks "
            "kernels by the step's size for speed (docs/performance.md)",
        )
        g.add_argument(
            "--max-model-len",
            type=ENGINE_TYPES["max_model_len"],
            default=None,
            help="tokens a sequence may hold, prompt and output (default: the model's context)",
        )
        g.add_argument("--max-num-seqs", type=ENGINE_TYPES["max_num_seqs"], default=64)
        g.add_argument(
            "--max-num-batched-tokens",
            type=ENGINE_TYPES["max_num_batched_tokens"],
            default=2048,
        )
        g.add_argument(
            "--max-prefill-admit-tokens",
            type=ENGINE_TYPES["max_prefill_admit_tokens"],
            default=None,
            help="admit new prompts into a step only while its prompt tokens are fewer than "
            "this (a prompt admitted is not cut short for it); 0: up to the step budget "
            f"(default: {CPU_PREFILL_ADMIT_TOKENS} on a CPU, 0 on a GPU)",
        )
        g.add_argument("--block-size", type=ENGINE_TYPES["block_size"], default=16)
        g.add_argument(
            "--kv-cache-memory",
            type=parse_size,
            default=None,
            help="KV cache budget, e.g. 2GiB (default: 1GiB on CPU; profiled on CUDA)",
        )
        g.add_argument(
            "--gpu-memory-utilization", type=ENGINE_TYPES["gpu_memory_utilization"], default=0.9
        )
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument(
            "--scheduling-policy", default="fcfs", choices=ENGINE_CHOICES["scheduling_policy"]
        )
        g.add_argument("--seed", type=int, default=0)
        g.add_argument(
            "--num-threads",
            type=ENGINE_TYPES["num_threads"],
            default=None,
            help="CPU threads for torch (default: every core)",
        )
        g.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=ENGINE_TYPES["tensor_parallel_size"],
            default=1,
            help="split every layer over this many ranks (processes; one per GPU on CUDA, "
            "sharing the cores on a CPU), each loading only its slices of the weights; "
            "--kv-cache-memory is per rank. On a 2-core CPU one rank is faster "
            "(docs/performance.md)",
        )
        g.add_argument(
            "--step-trace",
            default=None,
            metavar="FILE",
            help="append one JSON line per engine step (what it computed, how long it took); "
            "`servelm simulate --calibrate-trace FILE` fits a profile to it",
        )

    def prefill_admit_tokens(self, device_type: str) -> int:
        """The scheduler's cap on a step's prompt tokens for admitting new prompts, on a device
        of this type ("cpu", "cuda", ...): the flag's, else `CPU_PREFILL_ADMIT_TOKENS` on a
        CPU and none (0) elsewhere."""
        if self.max_prefill_admit_tokens is not None:
            return self.max_prefill_admit_tokens
        return CPU_PREFILL_ADMIT_TOKENS if device_type == "cpu" else 0

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
