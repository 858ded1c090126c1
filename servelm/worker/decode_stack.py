"""A step's whole layer stack as one C call (`kernels/decode_stack.c`).

    stack = DecodeStack.build(model, attn)    # None unless every piece of a layer is in C
    hidden = stack(input_ids, positions)      # None: this step is not one it takes

It takes steps of at most `max_rows` tokens (those whose matmuls read the int4 weights in C:
`StepPaths.stack_max_rows`, every step where it is batch invariant; a GGUF file's own
K-quant / Q8_0 projections, `GGUFWeight`, serve every step): decode steps and, where
the C prefill attention runs (AMX tiles, AVX-512 or AVX2), prompt and mixed steps too. It
returns what `model(input_ids, positions, attn)` returns for them, bit for bit: the C loop calls
the very kernels the Python layers call, in the same order, and only leaves out the Python
between them (which cost as much as the kernels at one token per request: docs/performance.md). Embedding,
rotary lookup, logits and sampling stay in Python. The attention metadata is the step's
`attn.meta`, planned as usual; the loop attends it part by part (`_Part`): each run of
consecutive decode rows in one call of the decode kernel (batch invariant: each decode row in a
call of the prefill kernel, as a prompt chunk of one), each request's prompt chunk in one call
of the prefill kernel. The name stays from when it took decode steps only.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from servelm.kernels.build import load_library
from servelm.kernels.paths import StepPaths

SOURCE = Path(__file__).parents[1] / "kernels" / "decode_stack.c"

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


# The C structs of decode_stack.c, field for field.
class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _ptr)
        for name in (
            "norm",
            "rotary",
            "silu",
            "q4",
            "attention",
            "prefill",
            "gguf",
            "q8",
            "prefill_many",
            "q4_silu",
        )
    ]


# `struct proj_part` kinds: how a part's rows are stored, by GGUFWeight's part kind
_PART_KINDS = {"q4": 0, "gguf": 1, "q8": 2}


class _ProjPart(ctypes.Structure):
    _fields_ = [*((name, _i64) for name in ("kind", "type", "start", "rows")), ("w", _ptr)]


class _Proj(ctypes.Structure):
    _fields_ = [("num_parts", _i64), ("parts", ctypes.POINTER(_ProjPart))]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("block_size", _i64),
        ("eps", _f32),
        ("scale", _f32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _ptr)
        for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "k_cache", "v_cache")
    ]


class _Part(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("start", "n", "prefill")),
        *((name, _ptr) for name in ("blocks", "context_lens")),
        *((name, _i64) for name in ("max_blocks", "max_len", "kept")),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("B", _i64),
        *((name, _ptr) for name in ("cos", "sin", "slots")),
        ("num_parts", _i64),
        ("parts", ctypes.POINTER(_Part)),
        ("prefill_scratch", _ptr),
        ("K", _i64),
        ("kept_rows", _ptr),
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("h", "qkv", "attn", "delta", "gate_up", "act", "part")]


def _address(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _projection(m) -> tuple[_Proj, object, int] | None:
    """A `Linear`'s weight as decode_stack.c's `struct proj`, the QuantMatmul that serves it
    and the most rows for which it does so in C (as `Linear._matmul` picks): its GGUF parts
    (`quant`), each by its own kernel, or its C int4 weight; None if it has a bias or neither."""
    if m.bias is not None:
        return None
    if m.quant is not None:
        q = m.quant
        parts = [
            _ProjPart(
                _PART_KINDS[kind],
                data[0] if kind == "gguf" else 0,
                start,
                rows,
                (data[1] if kind == "gguf" else data).data_ptr(),
            )
            for start, rows, kind, data in q.parts
        ]
        rows = q.max_rows
        if any(kind == "q4" for _, _, kind, _ in q.parts):  # q4 may leave C for wide inputs
            rows = min(rows, StepPaths.of(q.kernel).stack_max_rows)
        kernel = q.kernel
    elif m.int4 is not None and m.int4.kernel is not None:
        parts = [_ProjPart(_PART_KINDS["q4"], 0, 0, m.int4.rows, m.int4.packed.data_ptr())]
        kernel = m.int4.kernel
        rows = StepPaths.of(kernel).stack_max_rows
    else:
        return None
    table = (_ProjPart * len(parts))(*parts)
    proj = _Proj(len(parts), table)
    proj.table = table  # kept alive with it
    return proj, kernel, rows


class DecodeStack:
    def __init__(
        self,
        fn,
        model,
        attn,
        kernels: _Kernels,
        layers: list[_Layer],
        max_rows: int,
        projs: list[_Proj] | None = None,
    ) -> None:
        spec = model.spec
        self.fn, self.model, self.attn = fn, model, attn
        self.max_rows = max_rows
        self.projs = projs or []  # the layers point at these (and their parts' tables)
        self.kernels = kernels
        self.final_norm = model.norm.weight.data_ptr()
        self.layers = (_Layer * len(layers))(*layers)
        self.shape = _Shape(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            attn.block_size,
            model.norm.eps,
            attn.scale,
        )
        widest = max((p.parts[i].rows for p in self.projs for i in range(p.num_parts)), default=1)
        self.sizes = {  # scratch row lengths, as in decode_stack.c
            "h": spec.hidden_size,
            "qkv": spec.q_size + 2 * spec.kv_size,
            "attn": spec.q_size,
            "delta": spec.hidden_size,
            "gate_up": 2 * spec.intermediate_size,
            "act": spec.intermediate_size,
            "part": 2 * widest,  # float32 (q8 parts): two bfloat16 columns each
        }
        self._scratch: tuple[dict[str, torch.Tensor], _Scratch] | None = None

    @classmethod
    def build(cls, model, attn) -> DecodeStack | None:
        """The stack for `model` (a LlamaForCausalLM whose weights are loaded) over `attn`'s KV
        caches; None unless each layer runs only C kernels: the fused CPU ops, the C int4 or
        GGUF matmuls (no biases) and the C decode attention, all in bfloat16."""
        ops, decode = model.cpu_ops, attn.decode_kernel
        if ops is None or decode is None or decode.dtype != torch.bfloat16:
            return None
        if not model.c_layer_loop():  # a family whose layers do more than the Llama layer's
            return None
        if any(getattr(m, "reduce", None) for m in model.modules()):
            return None  # a tensor-parallel rank: its partial sums are reduced between layers
        norms = [model.norm.weight]
        for layer in model.layers:
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if model.rope.cos.dtype != torch.bfloat16 or any(
            w.dtype != torch.bfloat16 or not w.is_contiguous() for w in norms
        ):
            return None
        layers, projs, quant, max_rows = [], [], None, None
        for layer, (k_cache, v_cache) in zip(model.layers, attn.kv_caches, strict=True):
            mats = [
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ]
            made = [_projection(m) for m in mats]
            if any(p is None for p in made):
                return None
            for _, kernel, rows in made:
                if quant is not None and kernel is not quant:  # one library serves them all
                    return None
                quant = kernel
                max_rows = rows if max_rows is None else min(max_rows, rows)
            projs += [p for p, _, _ in made]
            layers.append(
                _Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    *(ctypes.addressof(p) for p, _, _ in made),
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                )
            )
        lib = load_library(SOURCE)
        if lib is None:
            return None
        fn = lib.decode_stack_bf16
        fn.argtypes, fn.restype = [_ptr] * 3 + [_i64] + [_ptr] * 5, None
        kernels = _Kernels(
            _address(ops.fns["add_rms_norm"][torch.bfloat16]),
            _address(ops.fns["rotary"][torch.bfloat16]),
            _address(ops.fns["silu_and_mul"][torch.bfloat16]),
            _address(quant.fns["q4"]),
            _address(decode.fn),
            _address(attn.prefill_kernel.fn) if attn.prefill_kernel is not None else None,
            _address(quant._gguf),  # gguf_matmul_bf16, as QuantMatmul.gguf calls it
            _address(quant.fns["q8"]),
            _address(attn.prefill_kernel.fn_many) if attn.prefill_kernel is not None else None,
            _address(quant.silu_fn),
        )
        return cls(fn, model, attn, kernels, layers, max_rows, projs)

    @property
    def takes_prompts(self) -> bool:
        """Whether steps with prompt tokens run here too (the C prefill attention is there)."""
        return self.attn.prefill_kernel is not None

    def _parts(self) -> tuple[ctypes.Array, int]:
        """This step's parts (see decode_stack.c) and the prefill scratch they need."""
        meta, parts, scratch = self.attn.meta, [], 0
        if meta.decode_lens is not None:  # runs of consecutive decode rows, one part each
            width, blocks = meta.decode_blocks.shape[1], meta.decode_blocks.data_ptr()
            lens = meta.decode_lens.data_ptr()
            for start, i, j, kept in meta.decode_runs:  # decode rows i .. j - 1; int64 tables
                table = blocks + 8 * i * width
                parts.append(
                    _Part(start, j - i, 0, table, lens + 8 * i, width, meta.decode_max_len, kept)
                )
        for c in meta.prefills:
            table = c.context_blocks
            parts.append(
                _Part(
                    c.start,
                    c.num_tokens,
                    1,
                    table.data_ptr(),
                    None,
                    table.numel(),
                    c.context_len,
                    c.kept,
                )
            )
        if meta.prefills:  # one buffer serves every chunk in turn: the longest context's
            cache = self.attn.kv_caches[0][0]
            longest = max(c.context_len for c in meta.prefills)
            scratch = self.attn.prefill_kernel.scratch(longest, cache.shape[1], cache.shape[2])
        return (_Part * len(parts))(*parts), scratch

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        meta = self.attn.meta
        B = input_ids.shape[0]
        if B > self.max_rows or not (meta.all_decode or self.takes_prompts):
            return None
        parts, scratch = self._parts()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rope.lookup(positions)
        out = torch.empty_like(x)
        kept = meta.kept_rows
        step = _Step(
            B,
            cos.data_ptr(),
            sin.data_ptr(),
            meta.slot_mapping.data_ptr(),
            len(parts),
            parts,
            scratch,
            B if kept is None else len(kept),
            None if kept is None else kept.data_ptr(),
        )
        self.fn(
            ctypes.byref(self.kernels),
            ctypes.byref(self.shape),
            self.layers,
            len(self.layers),
            self.final_norm,
            ctypes.byref(step),
            ctypes.byref(self.scratch(B)),
            x.data_ptr(),
            out.data_ptr(),
        )
        return out if kept is None else out[: len(kept)]

    def scratch(self, B: int) -> _Scratch:
        """Buffers for the rows between kernels, of at least B rows (the C code uses the first B
        of each); they grow by doubling, so a few sizes serve every batch."""
        if self._scratch is None or self._scratch[0]["h"].shape[0] < B:
            rows = max(B, 2 * self._scratch[0]["h"].shape[0] if self._scratch else B)
            bufs = {
                n: torch.empty(rows, size, dtype=torch.bfloat16) for n, size in self.sizes.items()
            }
            self._scratch = (bufs, _Scratch(**{n: t.data_ptr() for n, t in bufs.items()}))
        return self._scratch[1]
