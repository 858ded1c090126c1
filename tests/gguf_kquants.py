"""A quantizer for GGUF's Q4_K, Q5_K and Q6_K, for tests: the installed `gguf` package
dequantizes these types but cannot make them. Written from the block layouts (llama.cpp's
ggml-common.h; the `gguf` package's `quants.py` reads them back) with the plain choice of
scales each format allows, not llama.cpp's search for the best ones: the tests need valid
blocks whose weights are near the given ones, and read the exact weights back with `gguf`'s
own dequantization.

    raw = quantize_k(weights, Q.Q4_K)     # float32 [rows, cols], cols % 256 == 0
                                          # -> uint8 [rows, cols / 256 * 144]
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import quantize

Q = gguf.GGMLQuantizationType
QK_K = 256


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the 12 bytes Q4_K.get_scale_min unpacks: bytes
    0-3 hold sc[0-3] and sc[4-7]'s top 2 bits, 4-7 the same for m, 8-11 the low nibbles."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (5): w = d * sc * q - dmin * m over 8 sub-blocks of 32."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # a sub-block's offset: its minimum, never above 0
    step = (sub.max(-1) - low) / top
    d = _half(step.max(-1) / 63)
    dmin = _half(-low.min(-1) / 63)
    sc = np.clip(np.round(_safe_div(step, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(-low, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round(_safe_div(sub + offset[..., None], scale[..., None])), 0, top)
    q = q.astype(np.uint8)  # [blocks, 8, 32]
    # qs: byte 32p + i holds sub-block 2p's element i (low nibble) and 2p + 1's (high)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    parts.append(_pack_scales(sc, m))
    if bits == 5:  # qh: bit j of byte i is sub-block j's element i's fifth bit
        high = (q >> 4) & 1  # [blocks, 8, 32]
        qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: w = d * sc * (q - 32) over 16 sub-blocks of 16, sc int8."""
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = _half(step.max(-1) / 127)
    sc = np.clip(np.round(_safe_div(step, d.astype(np.float32)[:, None])), -128, 127)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(_safe_div(sub, scale[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # element 128h + 32s + i
    # ql[64h + 32(s % 2) + i]: nibble s // 2; qh[32h + i]: bits 2s, 2s + 1
    ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # [blocks, h, s % 2, 32]
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2)
    parts = [
        ql.reshape(-1, 128),
        qh.astype(np.uint8).reshape(-1, 64),
        sc.astype(np.int8).view(np.uint8),
        d.view(np.uint8).reshape(-1, 2),
    ]
    return np.concatenate(parts, axis=1)


def quantize_k(weights: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row bytes] of `qtype` blocks (K-quants here, the
    other types through gguf's own quantizer)."""
    rows, cols = weights.shape
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quantize(weights, qtype)
    assert cols % QK_K == 0, cols
    x = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1, QK_K)
    blocks = _q6_k(x) if qtype == Q.Q6_K else _q45_k(x, 4 if qtype == Q.Q4_K else 5)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of `qtype` blocks with every quant, scale and min random (and
    d, dmin set so that weights are about 1): every bit of the layout matters to the result."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    d = _half(rng.uniform(0.5, 1.0, len(raw))).view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q8_0:
        raw[:, 0:2] = _half(rng.uniform(0.005, 0.01, len(raw))).view(np.uint8).reshape(-1, 2)
    elif qtype == Q.Q6_K:
        raw[:, 208:210] = _half(rng.uniform(0.0005, 0.001, len(raw))).view(np.uint8).reshape(-1, 2)
    else:  # Q4_K, Q5_K: d and dmin
        small = _half(rng.uniform(0.002, 0.004, (len(raw), 2))).view(np.uint8)
        raw[:, 0:4] = small.reshape(-1, 4)
    del d
    return raw.reshape(rows, -1)
