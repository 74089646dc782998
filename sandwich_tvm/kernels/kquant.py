"""llama.cpp's Q4_K super-blocks regrouped as the q4_1 blocks the kernels read.

A Q4_K super-block holds 256 consecutive weights of a row in 144 bytes: an fp16 scale ``d`` and
minimum ``dmin``, eight 6-bit sub-scales ``sc`` and sub-minima ``mn`` packed in 12 bytes, and
256 4-bit values (sub-block ``2c`` in the low nibbles of bytes ``32c .. 32c + 31``, ``2c + 1``
in their high nibbles). Sub-block ``j`` (32 weights) decodes as
``w = d * sc[j] * q - dmin * mn[j]``: a q4_1 block (``w = q * d' + m'``) with
``d' = d * sc[j]`` and ``m' = -dmin * mn[j]``. So a Q4_K tensor runs on the q4_1 kernels with
every 4-bit value as it is; only ``d'`` and ``m'`` are rounded to fp16 (by at most 2^-11 of
themselves: a weight moves by under 1% of its block's step), and it reads 5 bits a weight
where the file holds 4.5.
"""

from __future__ import annotations

import numpy as np

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
        raise KernelError(f"{name}: a block scale d * sc exceeds fp16's range, so its Q4_K blocks "
                          "cannot run as q4_1; use --dtype q8_0")
    qs = sb[..., 16:].reshape(n, -1, SUBS // 2, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, -1, SUBS, 32)  # sub-block 2c: low, 2c + 1: high
    out = np.empty((n, q.shape[1], SUBS, 20), np.uint8)
    out[..., :4] = narrow.view(np.uint8).reshape(n, -1, SUBS, 4)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(n, -1)
