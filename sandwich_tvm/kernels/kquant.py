"""llama.cpp block types without kernels of their own, regrouped as blocks the kernels read
with every value as the file holds it: Q4_K as q4_1 blocks, Q5_0 as q8_0 blocks.

A Q4_K super-block holds 256 consecutive weights of a row in 144 bytes: an fp16 scale ``d`` and
minimum ``dmin``, eight 6-bit sub-scales ``sc`` and sub-minima ``mn`` packed in 12 bytes, and
256 4-bit values (sub-block ``2c`` in the low nibbles of bytes ``32c .. 32c + 31``, ``2c + 1``
in their high nibbles). Sub-block ``j`` (32 weights) decodes as
``w = d * sc[j] * q - dmin * mn[j]``: a q4_1 block (``w = q * d' + m'``) with
``d' = d * sc[j]`` and ``m' = -dmin * mn[j]``. So a Q4_K tensor runs on the q4_1 kernels with
every 4-bit value as it is; only ``d'`` and ``m'`` are rounded to fp16 (each by at most 2^-11
of itself, so a weight moves by at most 2^-11 (15 |d'| + |m'|): about 1% of a step in a block
around zero, 2^-11 of the weight in any), and it reads 5 bits a weight where the file holds 4.5.

A Q5_0 block (32 weights in 22 bytes: an fp16 ``d``, 32 high bits, 16 bytes of low nibbles)
decodes as ``w = d * (q - 16)``, q in 0..31: a q8_0 block with the same ``d`` and the int8
values ``q - 16``, exactly (8.5 bits a weight where the file holds 5.5).
"""

from __future__ import annotations

import numpy as np

REGROUP_FORMAT = 1  # keys converted weights: bump it when a regrouping changes
SUPER = 256  # weights per Q4_K super-block
Q4_K_BYTES = 144  # d, dmin (fp16), 12 bytes of sub-scales and sub-minima, 128 bytes of values
SUBS = SUPER // 32  # q4_1 blocks per super-block


def q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of sub-scales and sub-minima ``[..., 12]`` -> 6-bit ``(sc, mn)``, each
    ``[..., 8]`` (llama.cpp's ``get_scale_min_k4``): sub-blocks 0-3 in the low 6 bits of bytes
    0-3 and 4-7; sub-blocks 4-7 in the nibbles of bytes 8-11 with those bytes' top 2 bits."""
    s = np.asarray(packed, np.uint8)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def q4_k_as_q4_1(raw: np.ndarray, name: str = "a Q4_K tensor") -> np.ndarray:
    """Rows of Q4_K super-blocks ``[n, k / 256 * 144]`` -> the same weights as rows of q4_1
    blocks ``[n, k / 32 * 20]`` (GGUF's q4_1 layout: d, m, then byte j holding values j and
    j + 16). A block scale beyond fp16's range is a ``KernelError`` naming ``name``."""
    from .packing import KernelError

    n, width = raw.shape
    if width % Q4_K_BYTES:
        raise KernelError(f"{name}: {width} bytes a row is not a whole number of Q4_K super-blocks")
    sb = np.ascontiguousarray(raw, np.uint8).reshape(n, width // Q4_K_BYTES, Q4_K_BYTES)
    halves = sb[..., :4].copy().view(np.float16).astype(np.float32)  # [n, blocks, 2]: d, dmin
    sc, mn = q4_k_scales(sb[..., 4:16])
    with np.errstate(over="ignore", invalid="ignore"):
        wide = np.stack([halves[..., :1] * sc, -(halves[..., 1:] * mn)], axis=-1)  # [n, blocks, 8, 2]
        narrow = wide.astype(np.float16)
    if np.any(np.isinf(narrow) & np.isfinite(wide)):
        raise KernelError(f"{name}: a block scale d * sc or minimum dmin * mn exceeds fp16's range, so "
                          "its Q4_K blocks cannot run as q4_1; use --dtype q8_0")
    qs = sb[..., 16:].reshape(n, -1, SUBS // 2, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, -1, SUBS, 32)  # sub-block 2c: low, 2c + 1: high
    out = np.empty((n, q.shape[1], SUBS, 20), np.uint8)
    out[..., :4] = narrow.view(np.uint8).reshape(n, -1, SUBS, 4)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(n, -1)


Q5_0_BYTES = 22  # d (fp16), the 32 high bits (uint32), 16 bytes of low nibbles


def q5_0_as_q8_0(raw: np.ndarray, name: str = "a Q5_0 tensor") -> np.ndarray:
    """Rows of Q5_0 blocks ``[n, k / 32 * 22]`` -> the same weights as rows of q8_0 blocks
    ``[n, k / 32 * 34]``: value j's high bit is bit j of the block's ``qh``, its low 4 bits the
    low nibble of byte j (j < 16) or the high nibble of byte j - 16."""
    from .packing import KernelError

    n, width = raw.shape
    if width % Q5_0_BYTES:
        raise KernelError(f"{name}: {width} bytes a row is not a whole number of Q5_0 blocks")
    blocks = np.ascontiguousarray(raw, np.uint8).reshape(n, width // Q5_0_BYTES, Q5_0_BYTES)
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [n, blocks, 32]: bit j of qh
    nibbles = blocks[..., 6:]
    low = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # values 0..15, then 16..31
    out = np.empty((n, blocks.shape[1], 34), np.uint8)
    out[..., :2] = blocks[..., :2]
    out[..., 2:] = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(n, -1)


# GGML type -> (the weight dtype whose blocks hold it, the regrouping)
REGROUPED = {"Q4_K": ("q4_1", q4_k_as_q4_1), "Q5_0": ("q8_0", q5_0_as_q8_0)}
