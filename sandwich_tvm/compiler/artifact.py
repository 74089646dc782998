"""Compile the Relax Llama once and cache the shared library with what it was built for.

An artifact directory holds ``model.so`` (the Relax VM executable) and ``meta.json`` (model
config, parameter names and shapes, thread counts, which kernels were tuned or default). It is
keyed by everything that changes the code: the config, the plan's thread counts, the tuned
schedule files it used, the ISA and this package's compiler sources, so it reloads without
recompiling until one of them changes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..kernels.database import record_path
from ..kernels.shapes import linear_shapes
from ..model.attention import replace_cache_kernels
from ..model.config import LlamaConfig
from ..model.linear import KernelSet
from ..model.llama import LlamaForCausalLM
from ..runtime.plan import ExecPlan
from ..topology.profile import cache_dir, save_atomic
from ..tvm_compat import host_isa, host_target, tvm
from .pipeline import lowering_passes, schedule_passes, unscheduled

FORMAT = 1
_SOURCES = ("kernels/codegen.py", "kernels/vecmath.py", "kernels/defaults.py", "model/linear.py",
            "model/llama.py", "model/norm.py", "model/attention.py", "model/rope.py",
            "compiler/pipeline.py", "compiler/artifact.py")


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
    def stock(self) -> bool:
        return bool(self.meta["stock"])

    def load_vm(self, device: tvm.runtime.Device | None = None) -> tvm.relax.VirtualMachine:
        lib = tvm.runtime.load_module(str(self.path / "model.so"))
        return tvm.relax.VirtualMachine(lib, device or tvm.cpu())

    @classmethod
    def load(cls, path: Path) -> CompiledModel:
        meta_file = Path(path) / "meta.json"
        if not meta_file.is_file() or not (Path(path) / "model.so").is_file():
            raise CompileError(f"{path} is not a compiled model (no meta.json/model.so); run "
                               "`python -m sandwich_tvm.compile`")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT:
            raise CompileError(f"{path} was compiled by another sandwich-tvm version; recompile it")
        return cls(Path(path), meta)


def build_key(cfg: LlamaConfig, plan: ExecPlan, stock: bool, max_batch: int, root: Path | None) -> str:
    h = hashlib.sha256(json.dumps([FORMAT, cfg.to_dict(), stock, max_batch, host_isa(),
                                   plan.prefill_threads, plan.decode_threads, tvm.__version__],
                                  sort_keys=True).encode())
    pkg = Path(__file__).resolve().parents[1]
    for src in _SOURCES:
        h.update((pkg / src).read_bytes())
    if not stock:
        shapes = list(linear_shapes(cfg).values())
        for threads in {plan.prefill_threads, plan.decode_threads}:
            for shape in shapes:
                rec = record_path(shape, threads, root)
                if rec.is_file():
                    h.update(rec.read_bytes())
    return h.hexdigest()[:16]


def export_module(cfg: LlamaConfig, kernels: KernelSet | None) -> tuple[tvm.IRModule, list]:
    model = LlamaForCausalLM(cfg, kernels)
    mod, named = model.export_tvm(spec=model.get_default_spec())
    return mod, [(name, tuple(int(s) for s in p.shape)) for name, p in named]


def compile_model(cfg: LlamaConfig, plan: ExecPlan, *, stock: bool = False, max_batch: int = 8,
                  out: Path | None = None, root: Path | None = None, force: bool = False,
                  log: Callable[[str], None] = lambda _msg: None) -> CompiledModel:
    """Build (or reuse) the model for ``plan``. ``stock=True``: TVM's own build (``nn.Linear``,
    the default Relax pipeline), the baseline."""
    key = build_key(cfg, plan, stock, max_batch, root)
    out = out or cache_dir() / "compiled" / f"{cfg.name}-{'stock' if stock else 'sandwich'}-{key}"
    if not force and (out / "meta.json").is_file():
        try:
            cached = CompiledModel.load(out)
            if cached.meta.get("key") == key:
                log(f"reusing the compiled model in {out}")
                return cached
        except (CompileError, json.JSONDecodeError):
            pass
    kernels = None if stock else KernelSet(plan.prefill_threads, plan.decode_threads, max_batch, root)
    target = host_target(max(plan.prefill_threads, plan.decode_threads))
    t0 = time.perf_counter()
    log("exporting the Relax model" + (" (stock nn.Linear)" if stock else " with Sandwich kernels"))
    mod, params = export_module(cfg, kernels)
    log(f"compiling with {'the default' if stock else 'the sandwich'} Relax pipeline for {target}")
    try:
        if stock:
            exe = tvm.compile(mod, target)
            naive = []
        else:
            mod = replace_cache_kernels(mod, cfg, plan.decode_threads)
            with target:
                scheduled = tvm.transform.Sequential(schedule_passes(target))(mod)
                naive = unscheduled(scheduled)
                lowered = tvm.transform.Sequential(lowering_passes(target))(scheduled)
            exe = tvm.compile(lowered, target, relax_pipeline=None)
    except Exception as err:  # TVM raises many types; report where it happened
        raise CompileError(f"compiling {cfg.name} failed: {err}") from err
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    exe.export_library(str(tmp / "model.so"))
    meta = {
        "format": FORMAT, "key": key, "config": cfg.to_dict(), "stock": stock,
        "params": [[n, list(s)] for n, s in params], "isa": host_isa(), "max_batch": max_batch,
        "prefill_threads": plan.prefill_threads, "decode_threads": plan.decode_threads,
        "kernels": {f"{p}/{s}": src for (p, s), src in (kernels.sources.items() if kernels else [])},
        "unscheduled": naive, "seconds": round(time.perf_counter() - t0, 1),
    }
    save_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    log(f"compiled in {meta['seconds']} s -> {out}")
    return CompiledModel(out, meta)
