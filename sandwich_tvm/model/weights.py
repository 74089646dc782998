"""Weights: an HF checkpoint (``model.checkpoint``) or seeded random weights for a preset,
converted once to the layout the compiled model reads (cached) and placed in 2 MiB pages.

HF names map to ours as MLC-LLM does: ``qkv_proj = cat(q, k, v)``, ``gate_up_proj =
cat(gate, up)``. A Linear weight whose parameter is 3-D is packed into kernel panels
(``kernels.codegen.pack_weight``). Decode at batch 1 streams every weight once per token,
so weights live in anonymous memory advised ``MADV_HUGEPAGE`` (notes §8).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..host import cache_dir, file_mode
from ..kernels.codegen import fuses_silu_mul
from ..kernels.kquant import REGROUP_FORMAT
from ..kernels.packing import WeightLayout, numpy_dtype
from ..kernels.quant import QTYPES, WEIGHTED_FORMAT, QType, QuantBlocks, head_dtype, row_mean_square
from ..memory import aligned_empty, collapse_huge_pages
from .checkpoint import ModelLoadError, check_checkpoint, checkpoint_files, random_checkpoint, read_checkpoint
from .config import LlamaConfig, model_path
from .imatrix import imatrix_digest, importance_of, read_imatrix
from .parallel import Shard
from .rope import at_context

FORMAT = 2  # 2: gate_up interleaved for the silu_mul epilogue


# --------------------------------------------------------------------------- conversion

_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "self_attn.qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _hf_tensor(state: dict[str, np.ndarray], name: str, cfg: LlamaConfig,
               where: str, want: QType | None = None) -> np.ndarray | QuantBlocks:
    """The HF tensor (or fused q|k|v, gate|up) for one of our parameters. Packed as ``want``
    blocks, the fused parts a GGUF holds in that type stay its blocks and only the others are
    quantized (blocks are per row, so the fused rows are those of quantizing each part)."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    for ours, parts in _FUSED.items():
        if name.endswith(ours) and name not in state:  # a Phi-3 holds the fused matrix itself
            prefix = name[: -len(ours)]
            tensors = [_get(state, prefix + p, where) for p in parts]
            if all(isinstance(t, QuantBlocks) and t.qtype == tensors[0].qtype for t in tensors):
                return QuantBlocks.concat(tensors)  # a GGUF's blocks stay blocks
            if want is not None and any(isinstance(t, QuantBlocks) and t.qtype == want for t in tensors):
                own = [t if isinstance(t, QuantBlocks) and t.qtype == want
                       else QuantBlocks(want.quantize(np.asarray(t, np.float32)), want, t.shape[1],
                                        lambda t=t: np.asarray(t, np.float32)) for t in tensors]
                return QuantBlocks.concat(own)
            return np.concatenate([np.asarray(t) for t in tensors], axis=0)
    return _get(state, name, where)


def _get(state: dict[str, np.ndarray], name: str, where: str) -> np.ndarray | QuantBlocks:
    if name not in state:
        raise ModelLoadError(f"{where}: tensor {name!r} is missing; is this a Llama checkpoint "
                             "matching its config.json?")
    t = state[name]  # a GGUF's quantized tensors stay GGUF blocks until a layout takes or dequantizes them
    return t if isinstance(t, QuantBlocks) else np.asarray(t)


def convert(cfg: LlamaConfig, state: dict[str, np.ndarray], params: list[tuple[str, tuple[int, ...]]],
            isa: str, where: str = "checkpoint",
            progress: Callable[[int, int], None] | None = None, dtype: str = "float32",
            layouts: dict[str, WeightLayout] | None = None, shards: dict[str, Shard] | None = None,
            rank: int = 0, tp: int = 1, importance: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Arrays in ``params`` order (name, expected shape), packed where the shape is 3-D: as
    ``layouts[name]`` (the model's own, from its parameters) when given, else for the
    ``dtype`` kernels of ``isa`` (a micro-kernel ISA). In a model split over ``tp`` processes
    each parameter with a hint in ``shards`` is rank ``rank``'s part. ``importance``: an
    importance matrix (``imatrix.read_imatrix``) that 4-bit weights quantized here are
    weighted by. The checkpoint must match ``cfg`` exactly (``check_checkpoint``); tensors are
    read one at a time."""
    check_checkpoint(cfg, state, where)
    out = []
    for i, (name, shape) in enumerate(params):
        imp, sigma2 = importance_of(importance, name), None
        layout = _layout_of(name, shape, cfg, isa, dtype, layouts)
        hf = _hf_tensor(state, name, cfg, where, layout.quant if layout is not None and imp is None else None)
        if tp > 1 and name in (shards or {}):
            shard = shards[name]
            # a GGUF's blocks stay blocks (a re-rounding would move values); else dequantized
            part = shard.take_blocks(hf, rank, tp) if isinstance(hf, QuantBlocks) else None
            if imp is not None and shard.dim == 1:  # this rank's columns of whole rows
                imp = shard.take(imp[None, :], rank, tp)[0]
                sigma2 = row_mean_square(hf)  # rounded as one process rounds
            hf = part if part is not None else shard.take(np.asarray(hf), rank, tp)
        if layout is not None:  # packed panels of W[n, k]
            if hf.ndim != 2 or layout.shape(*hf.shape) != tuple(shape):
                raise ModelLoadError(f"{name}: the model was built for panels {list(shape)}, but "
                                     f"{list(hf.shape)} packs to {list(layout.shape(*hf.shape))} for "
                                     f"{isa} {dtype}; build and load the model for the same ISA, dtype "
                                     "and config")
            arr = layout.pack(hf, out=aligned_empty(shape, numpy_dtype(layout.storage)), importance=imp,
                              row_sigma2=sigma2)
        else:
            if tuple(hf.shape) != tuple(shape):
                raise ModelLoadError(f"{where}: {name} has shape {list(hf.shape)}, but config.json "
                                     f"implies {list(shape)}")
            arr = aligned_empty(shape)
            arr[...] = np.asarray(hf)
        out.append(arr)
        if progress:
            progress(i + 1, len(params))
    return out


def _layout_of(name: str, shape: tuple[int, ...], cfg: LlamaConfig, isa: str, dtype: str,
               layouts: dict[str, WeightLayout] | None) -> WeightLayout | None:
    """How a 3-D (packed) parameter is stored: the model's own layout, else the ``dtype`` kernels'
    of ``isa`` (gate_up interleaved for the silu_mul epilogue); None for a plain array."""
    if len(shape) != 3:
        return None
    if (layouts or {}).get(name) is not None:
        return layouts[name]
    gate_up = name.endswith("mlp.gate_up_proj.weight")
    own = head_dtype(dtype) if name in ("lm_head.weight", "model.embed_tokens.weight") else dtype
    return WeightLayout(isa, own, gate_up and fuses_silu_mul(cfg.intermediate_size, isa))


# --------------------------------------------------------------------------- the conversion cache

FULL_HASH_BYTES = 64 << 20  # files up to this size are hashed whole
SAMPLE_BYTES = 4096  # else: this much from the start, middle and end of every tensor


def checkpoint_key(model_dir: Path, layout: str, cfg: LlamaConfig | None = None) -> str:
    """The conversion cache key: the parameter layout (names, packed shapes, ISA), the config and
    the checkpoint's content -- not its file names or times, which a different model can share.

    Per safetensors file it hashes the 8-byte header length and the JSON header (every tensor's
    name, dtype, shape and offsets), then the data: whole for files up to ``FULL_HASH_BYTES``;
    for larger ones ``SAMPLE_BYTES`` from the start, middle and end of every tensor. Hashing
    16 GB whole would take longer than reading the cache it guards; a fine-tune or another
    model with the same shapes changes every element of the tensors it touches, so samples of
    every tensor tell them apart, while an edit of a few values inside a large tensor would
    not be seen (delete ``$SANDWICH_CACHE/weights`` to force a conversion then). A GGUF is
    hashed the same way after its header (metadata and tensor table).
    """
    h = hashlib.sha256(f"{FORMAT}|{layout}".encode())
    if cfg is not None:  # the weights of any context (LongRoPE's set, a window: no weight changes)
        fields = at_context(cfg, 0).to_dict().items()
        h.update(json.dumps({k: v for k, v in fields if k not in ("name", "sliding_window")},
                            sort_keys=True, default=str).encode())
    model_dir = model_path(model_dir)
    if model_dir.suffix == ".gguf":  # its header, then the same whole-or-sampled data
        from .gguf import hash_gguf

        hash_gguf(model_dir, h, FULL_HASH_BYTES, SAMPLE_BYTES)
        return h.hexdigest()[:16]
    for f in checkpoint_files(model_dir):
        h.update(f.name.encode() + b"\0")
        try:
            _hash_safetensors(f, h)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{f} cannot be read ({err}); re-download it") from err
    return h.hexdigest()[:16]


def _hash_safetensors(path: Path, h) -> None:
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, 100 << 20):
            raise ValueError(f"header length {header_len} does not fit the file of {size} bytes")
        header = fh.read(header_len)
        h.update(head + header + str(size).encode())
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
            return
        base = 8 + header_len
        for name, info in sorted(json.loads(header).items()):
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            for start in sorted({lo, max(lo, (lo + hi - SAMPLE_BYTES) // 2), max(lo, hi - SAMPLE_BYTES)}):
                fh.seek(base + start)
                h.update(fh.read(min(SAMPLE_BYTES, hi - start)))


def converted_cache_path(model_dir: Path, layout: str, cfg: LlamaConfig | None = None) -> Path:
    key = checkpoint_key(model_dir, layout, cfg)
    return cache_dir() / "weights" / f"{model_path(model_dir).name}-{key}.safetensors"


def save_converted(path: Path, params: list[tuple[str, tuple[int, ...]]], arrays: list[np.ndarray],
                   log: Callable[[str], None] = lambda _m: None) -> None:
    """Written to a temporary name of its own, then renamed: an interrupted save, or two processes
    converting the same model at once, leave no corrupt cache. A save that fails (a full disk)
    is logged and skipped: the arrays in hand are good, only the next start converts again."""
    import os
    import tempfile
    import time

    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a save killed a day ago or more
            if time.time() - stale.stat().st_mtime > 86400:
                stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        # safetensors' numpy API has no bfloat16: such arrays are stored as their 16-bit words
        save_file({name: np.ascontiguousarray(a.view(np.uint16) if a.dtype == numpy_dtype("bfloat16") else a)
                   for (name, _), a in zip(params, arrays, strict=True)}, tmp)
        os.chmod(tmp, file_mode())  # as an ordinary file, not mkstemp's 0600: caches may be shared
        os.replace(tmp, path)
    except (OSError, SafetensorError) as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        log(f"the converted weights were not cached ({err}); the next start converts them again")


def load_converted(path: Path, params: list[tuple[str, tuple[int, ...]]],
                   dtype: str = "float32") -> list[np.ndarray] | None:
    """The cached conversion, copied into 2 MiB pages; None when absent or unreadable. Packed
    (3-D) weights of a bfloat16 model come back as bfloat16 from their stored 16-bit words."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        out = []
        with safe_open(str(path), framework="numpy") as fh:
            for name, shape in params:
                src = fh.get_tensor(name)
                if tuple(src.shape) != tuple(shape):
                    return None
                if len(shape) == 3 and dtype == "bfloat16" and src.dtype == np.uint16:
                    src = src.view(numpy_dtype("bfloat16"))
                arr = aligned_empty(shape, src.dtype)
                arr[...] = src
                out.append(arr)
        return out
    except (SafetensorError, OSError, KeyError, ValueError):
        path.unlink(missing_ok=True)  # a corrupt cache is rebuilt from the checkpoint
        return None


# --------------------------------------------------------------------------- entry point

def load_params(spec: str | Path, cfg: LlamaConfig, params: list[tuple[str, tuple[int, ...]]], isa: str,
                *, seed: int = 0, log: Callable[[str], None] = lambda _m: None,
                dtype: str = "float32", layouts: dict[str, WeightLayout] | None = None,
                shards: dict[str, Shard] | None = None, rank: int = 0, tp: int = 1,
                imatrix: Path | str | None = None) -> list[np.ndarray]:
    """Weights for ``params``: a preset's seeded random weights, or the checkpoint in ``spec``
    (converted once, then read from the conversion cache); Linear weights in ``dtype``, packed
    as ``layouts`` says (the compiled model's, ``CompiledModel.layouts``) where given; rank
    ``rank``'s shard of a model split over ``tp`` processes (``CompiledModel.shards``); 4-bit
    weights quantized here weighted by the importance matrix file ``imatrix``."""
    arrays = _load_params(spec, cfg, params, isa, seed=seed, log=log, dtype=dtype, layouts=layouts,
                          shards=shards, rank=rank, tp=tp, imatrix=imatrix)
    collapse_huge_pages(arrays)  # decode streams them every token: all in 2 MiB pages, now
    return arrays


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "none"


def conversion_progress(log: Callable[[str], None], every_s: float = 5.0) -> Callable[[int, int], None]:
    """A ``convert`` progress callback that logs ``done/total`` at most every ``every_s`` seconds
    (and at the end, when it took that long): a large or weighted conversion takes minutes."""
    import time

    start = last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s or (done == total and now - start >= every_s):
            last = now
            log(f"converting: {done}/{total} tensors, {now - start:.0f} s")

    return report


def _load_params(spec: str | Path, cfg: LlamaConfig, params: list[tuple[str, tuple[int, ...]]], isa: str,
                 *, seed: int, log: Callable[[str], None], dtype: str,
                 layouts: dict[str, WeightLayout] | None, shards: dict[str, Shard] | None, rank: int,
                 tp: int, imatrix: Path | str | None) -> list[np.ndarray]:
    from .config import PRESETS

    if QTYPES.get(dtype) is None or QTYPES[dtype].bits != 4:
        imatrix = None  # nothing it rounds (a stock fp32 build of a q4 spec): the same conversion
    split = {"shards": shards, "rank": rank, "tp": tp, "progress": conversion_progress(log),
             "importance": read_imatrix(imatrix, cfg) if imatrix else None}
    if str(spec) in PRESETS:
        log(f"random weights for preset {spec} (seed {seed})" + (f", rank {rank}'s shard" if tp > 1 else ""))
        return convert(cfg, random_checkpoint(cfg, seed), params, isa, where=f"preset {spec}", dtype=dtype,
                       layouts=layouts, **split)
    model_dir = model_path(spec)
    layout = json.dumps([params, isa] + ([dtype] if dtype != "float32" else [])
                        + ([sorted((n, x.to_json()) for n, x in layouts.items())] if layouts else [])
                        + ([rank, tp, sorted((n, x.to_json()) for n, x in (shards or {}).items())]
                           if tp > 1 else [])
                        + ([f"imatrix {imatrix_digest(imatrix)} {WEIGHTED_FORMAT}"] if imatrix else [])
                        + ([f"gguf {_gguf_version()} regroup {REGROUP_FORMAT}"] if dtype in QTYPES
                           else []))  # its quantizer rounds; K-quants and Q5_0 regrouped
    cached = converted_cache_path(model_dir, layout, cfg)
    arrays = load_converted(cached, params, dtype)
    if arrays is not None:
        log(f"weights from the conversion cache {cached}")
        return arrays
    log(f"converting {model_dir} (once; cached in {cached})")
    arrays = convert(cfg, read_checkpoint(model_dir), params, isa, where=str(model_dir), dtype=dtype,
                     layouts=layouts, **split)
    save_converted(cached, params, arrays, log)
    return arrays
