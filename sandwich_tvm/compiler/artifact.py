"""Compile the Relax Llama once and cache the shared library with what it was built for.

An artifact directory holds ``model.so`` (the Relax VM executable) and ``meta.json`` (model
config, parameter names and shapes, thread counts, which kernels were tuned or default, and
the SHA-256 of ``model.so``). It is keyed by everything that changes the code: the config, the
plan's thread counts, the tuned schedule records it used, the CPU signature and target, the
TVM version and every source of this package that shapes generated code, so it reloads
without recompiling until one of them changes. A damaged ``model.so`` (checksum mismatch) is
rebuilt; ``compile --out DIR`` writes only ``DIR/model.so`` and ``DIR/meta.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..host import HostError, cache_dir, ensure_writable, host_signature, save_atomic, sha256_file
from ..kernels.codegen import KernelError
from ..kernels.database import ScheduleDbError, find_record
from ..kernels.packing import WeightLayout
from ..model.config import LlamaConfig
from ..model.linear import KernelSet
from ..model.llama import LlamaForCausalLM
from ..model.parallel import Shard, ShardError
from ..model.rope import stock_problem
from ..model.separation import ATTENTION, WEIGHTS, AttentionRank, Role
from ..model.shapes import linear_shapes
from ..model.stages import Stage, split_layers
from ..spec import RunSpec
from ..tvm_compat import host_isa, host_target, linker_for, tvm
from .kv_cache import replace_cache_kernels
from .phases import select_phase_kernels
from .pipeline import lowering_passes, schedule_passes, unscheduled

FORMAT = 3  # 3: the config describes the checkpoint only (no dtype)
PACKAGE = Path(__file__).resolve().parents[1]
# Everything that shapes generated code: the kernel generator and search, the model, the
# passes, and the TVM/host glue (target features, TVMScript parsing).
_SOURCE_GLOBS = ("kernels/*.py", "kernels/*/*.py", "model/*.py", "compiler/*.py", "tvm_compat.py", "host.py",
                 "spec.py")


def source_files() -> list[Path]:
    return sorted({f for pattern in _SOURCE_GLOBS for f in PACKAGE.glob(pattern)})


class CompileError(RuntimeError):
    """Compilation failed; the message says at which step."""


@dataclass
class CompiledModel:
    """A built model: where its library is and what it expects."""

    path: Path
    meta: dict

    @property
    def config(self) -> LlamaConfig:
        return LlamaConfig(**self.meta["config"])

    @property
    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(s)) for n, s in self.meta["params"]]

    @property
    def layouts(self) -> dict[str, WeightLayout]:
        """How each packed parameter is laid out (its ``WeightLayout``, from the model)."""
        return {n: WeightLayout.from_json(d) for n, d in self.meta.get("layouts", {}).items()}

    @property
    def shards(self) -> dict[str, Shard]:
        """How each parameter of a tensor-parallel model is split over the ranks (its hint)."""
        return {n: Shard.from_json(d) for n, d in self.meta.get("shards", {}).items()}

    @property
    def tp(self) -> int:
        """The processes the model is sharded for (1: unsharded)."""
        return int(self.meta.get("tp", 1))

    @property
    def stage(self) -> Stage | None:
        """The pipeline stage this library runs (None: the whole model)."""
        d = self.meta.get("stage")
        return None if d is None else Stage(**d)

    @property
    def role(self) -> Role | None:
        """The side of a weight-attention separated model this library runs (None: neither)."""
        d = self.meta.get("role")
        return None if d is None else Role(**d)

    @property
    def weight_layout(self) -> tuple[str, str]:
        """(micro-kernel ISA, weight dtype) the packed parameters are laid out for."""
        return self.meta.get("kernel_isa", self.meta["isa"]), self.meta.get("dtype", "float32")

    @property
    def stock(self) -> bool:
        return bool(self.meta["stock"])

    def load_vm(self, device: tvm.runtime.Device | None = None) -> tvm.relax.VirtualMachine:
        lib = tvm.runtime.load_module(str(self.path / "model.so"))
        return tvm.relax.VirtualMachine(lib, device or tvm.cpu())

    @classmethod
    def load(cls, path: Path) -> CompiledModel:
        """Read ``meta.json`` and verify ``model.so`` against its checksum (a truncated library
        would crash the process with a bus error when loaded)."""
        path = Path(path)
        meta_file, lib = path / "meta.json", path / "model.so"
        if not meta_file.is_file() or not lib.is_file():
            raise CompileError(f"{path} is not a compiled model (no meta.json/model.so); run "
                               "`python -m sandwich_tvm.compile`")
        try:
            meta = json.loads(meta_file.read_text())
            fmt, digest, size = meta.get("format"), meta.get("sha256"), meta.get("bytes")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
            raise CompileError(f"{meta_file} is damaged ({err}); recompile with --force") from err
        if fmt != FORMAT:
            raise CompileError(f"{path} was compiled by another sandwich-tvm version; recompile with --force")
        if lib.stat().st_size != size or sha256_file(lib) != digest:
            raise CompileError(f"{lib} is damaged (its size or SHA-256 differs from meta.json); "
                               "recompile with --force, or delete it")
        return cls(path, meta)


def model_part(spec: RunSpec, index: int | None) -> Stage | Role | None:
    """Part ``index`` of the spec's plan: a pipeline stage, or a side of a weight-attention
    separated model (None for a plan whose ranks all run one model)."""
    plan = spec.plan
    if not plan.parts:
        return None
    if index is None:
        what = f"{plan.pp} pipeline stages" if plan.pp > 1 else "a weight side and an attention side"
        raise CompileError(f"the plan has {what}: compile each part")
    if plan.wa:
        if index not in (0, 1):
            raise CompileError(f"a separated model has parts 0 (weights) and 1 (attention), not {index}")
        return Role((WEIGHTS, ATTENTION)[index])
    try:
        return split_layers(spec.config.num_hidden_layers, plan.pp)[index]
    except ValueError as err:
        raise CompileError(str(err)) from None


def build_key(spec: RunSpec, stage: Stage | Role | None = None) -> str:
    """Everything that changes the generated code: the spec's model, dtypes, batch, thread
    counts and records, the part (pipeline stage or separated side), the CPU, the target, the TVM
    version and this package's sources."""
    cfg, plan = spec.config, spec.plan
    target = host_target(max(plan.prefill_threads, plan.decode_threads))
    h = hashlib.sha256(json.dumps([FORMAT, cfg.to_dict(), spec.stock, spec.max_batch, spec.kv_dtype,
                                   spec.weight_dtype, spec.act_dtype, spec.int8_activations, plan.tp,
                                   spec.built_wider,
                                   _part_json(stage), host_signature().to_json(),
                                   str(target), plan.prefill_threads, plan.decode_threads,
                                   tvm.__version__], sort_keys=True).encode())
    for src in source_files():
        h.update(src.name.encode() + src.read_bytes())
    if not spec.stock and not (isinstance(stage, Role) and stage.name == ATTENTION):  # no Linears there
        shapes = list(linear_shapes(cfg, spec.weight_dtype, plan.tp, wider=spec.wider_linears).values())
        for threads in sorted({plan.prefill_threads, plan.decode_threads}):
            for shape in shapes:
                rec = find_record(shape, threads, spec.records)
                if rec is not None:
                    h.update(json.dumps(rec.to_json(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def _part_json(part: Stage | Role | None) -> dict | None:
    if part is None:
        return None
    return {"role": part.to_json()} if isinstance(part, Role) else part.to_json()


def export_module(cfg: LlamaConfig, kernels: KernelSet | None, kv_dtype: str = "float32", tp: int = 1,
                  stage: Stage | Role | None = None) -> tuple[tvm.IRModule, list]:
    mod, params, _ = export_with_layouts(cfg, kernels, kv_dtype, tp, stage)
    return mod, params


def export_with_layouts(cfg: LlamaConfig, kernels: KernelSet | None, kv_dtype: str = "float32", tp: int = 1,
                        stage: Stage | Role | None = None) -> tuple[tvm.IRModule, list, dict[str, dict]]:
    """The Relax module, its parameters (name, shape) and the hints riding on them: ``layout``
    (a ``WeightLayout``) of every packed one and ``shard`` (a ``Shard``) of every split one.
    A pipeline stage's parameters keep the whole model's names; a separated model's attention
    side has none."""
    if isinstance(stage, Role):
        model = (AttentionRank(cfg, kv_dtype) if stage.name == ATTENTION
                 else LlamaForCausalLM(cfg, kernels, kv_dtype, tp, role=stage))
    else:
        model = LlamaForCausalLM(cfg, kernels, kv_dtype, tp, stage)
    mod, named = model.export_tvm(spec=model.get_default_spec())
    rename = stage.global_name if isinstance(stage, Stage) else (lambda n: n)
    named = [(rename(name), p) for name, p in named]
    hints = {key: {name: p.attrs[key] for name, p in named if key in p.attrs} for key in ("layout", "shard")}
    return mod, [(name, tuple(int(s) for s in p.shape)) for name, p in named], hints


def compile_model(spec: RunSpec, *, out: Path | None = None, force: bool = False,
                  log: Callable[[str], None] = lambda _msg: None, stage: int | None = None) -> CompiledModel:
    """Build (or reuse) the model ``spec`` describes: its plan's thread counts, weight and KV
    dtypes, batch and records; with pipeline stages, stage ``stage``'s part. ``spec.stock``:
    TVM's own build (``nn.Linear``, the default Relax pipeline, fp32 weights and cache), the
    baseline."""
    cfg, plan, stock, max_batch = spec.config, spec.plan, spec.stock, spec.max_batch
    kv_dtype, dtype, root = spec.kv_dtype, spec.weight_dtype, spec.records
    if stock and (kind := stock_problem(cfg)):
        raise CompileError(f"TVM's stock build cannot run {cfg.name} as transformers does: {kind}; run it "
                           "without --stock")
    part = model_part(spec, stage)
    try:
        key = build_key(spec, part)
    except ScheduleDbError as err:
        raise CompileError(str(err)) from err
    flavour = ("stock" if stock else "sandwich") + (
        f"-{part.name}" if isinstance(part, Role) else f"-stage{part.index}of{part.count}" if part else "")
    out = Path(out) if out else cache_dir() / "compiled" / f"{cfg.name}-{flavour}-{key}"
    _check_out_dir(out)
    if not force and (out / "meta.json").is_file():
        try:
            cached = CompiledModel.load(out)
            if cached.meta.get("key") == key:
                log(f"reusing the compiled model in {out}")
                return cached
        except CompileError as err:
            log(f"{err}: rebuilding it")
    try:
        ensure_writable(out, "artifact directory")
    except HostError as err:
        raise CompileError(str(err)) from err
    if stock and plan.processes > 1:
        raise CompileError(f"the stock TVM build runs one process; the plan has {plan.processes} (tensor "
                           "and pipeline parallelism are Sandwich's)")
    kernels = None if stock else KernelSet(plan.prefill_threads, plan.decode_threads, max_batch, root,
                                           dtype=dtype, int8_activations=spec.int8_activations,
                                           wider={(layer, name): d for layer, name, d in spec.wider_linears})
    target = host_target(max(plan.prefill_threads, plan.decode_threads))
    try:
        linker = linker_for(target)  # another architecture's (SANDWICH_CPU): zig cc, before compiling
    except HostError as err:
        raise CompileError(str(err)) from err
    t0 = time.perf_counter()
    log("exporting the Relax model" + (" (stock nn.Linear)" if stock else " with Sandwich kernels")
        + (f", the {part.name} side of weight-attention separation" if isinstance(part, Role) else
           f", pipeline stage {part.index + 1} of {part.count} (layers {part.first_layer}.."
           f"{part.end_layer - 1})" if part else ""))
    try:
        mod, params, hints = export_with_layouts(cfg, kernels, kv_dtype, plan.tp, part)
    except (ScheduleDbError, KernelError, ShardError) as err:
        raise CompileError(str(err)) from err
    log(f"compiling with {'the default' if stock else 'the sandwich'} Relax pipeline for {target}")
    try:
        if stock:
            exe = tvm.compile(mod, target)
            naive = []
        else:
            mod = select_phase_kernels(kernels)(mod)
            mod = replace_cache_kernels(mod, cfg, plan.decode_threads, kernels.isa, kv_dtype=kv_dtype,
                                        tp=plan.tp, amx=kernels.kernel_isa == "amx")
            with target:
                scheduled = tvm.transform.Sequential(schedule_passes(target))(mod)
                naive = unscheduled(scheduled)
                lowered = tvm.transform.Sequential(lowering_passes(target))(scheduled)
            exe = tvm.compile(lowered, target, relax_pipeline=None)
    except Exception as err:  # TVM raises many types; report where it happened
        raise CompileError(f"compiling {cfg.name} failed: {err}") from err
    lib = _export_atomic(exe, out, linker)
    meta = {
        "format": FORMAT, "key": key, "config": cfg.to_dict(), "stock": stock,
        "params": [[n, list(s)] for n, s in params], "isa": host_isa(), "max_batch": max_batch,
        "layouts": {n: layout.to_json() for n, layout in hints["layout"].items()},
        "tp": plan.tp, "shards": {n: shard.to_json() for n, shard in hints["shard"].items()},
        "stage": part.to_json() if isinstance(part, Stage) else None,
        "role": part.to_json() if isinstance(part, Role) else None,
        "kv_dtype": kv_dtype, "dtype": dtype, "kernel_isa": kernels.kernel_isa if kernels else host_isa(),
        "cpu": host_signature().to_json(), "target": str(target),
        "prefill_threads": plan.prefill_threads, "decode_threads": plan.decode_threads,
        "kernels": {f"{p}/{s}": src for (p, s), src in (kernels.sources.items() if kernels else [])},
        "unscheduled": naive, "seconds": round(time.perf_counter() - t0, 1),
        "sha256": sha256_file(lib), "bytes": lib.stat().st_size,
    }
    save_atomic(out / "meta.json", json.dumps(meta, indent=1))
    log(f"compiled in {meta['seconds']} s -> {out}")
    return CompiledModel(out, meta)


def _check_out_dir(out: Path) -> None:
    """Refuse a directory whose ``model.so`` is not one of ours: it is not ours to overwrite."""
    if out.exists() and not out.is_dir():
        raise CompileError(f"--out {out} is a file, not a directory")
    if (out / "model.so").exists() and not (out / "meta.json").is_file():
        raise CompileError(f"{out} holds a model.so that sandwich-tvm did not write (no meta.json); "
                           "choose another --out directory")


def _export_atomic(exe, out: Path, linker=None) -> Path:
    """Write ``out/model.so`` via a temporary file in ``out`` and a rename; nothing else is
    touched. ``linker``: ``export_library``'s ``fcompile`` (None: this machine's compiler)."""
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".model.", suffix=".so")
    os.close(fd)
    try:
        exe.export_library(tmp, fcompile=linker)
        os.replace(tmp, out / "model.so")
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out / "model.so"
