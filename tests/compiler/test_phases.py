"""The kernel choice per phase is a Relax pass: the model calls prefill kernels, the pass gives
the decode functions the decode kernels of the same GEMMs (``decode``, whose m is 1, the
single-bucket kernel for m = 1)."""

from __future__ import annotations

from dataclasses import replace

from tvm import relax

from sandwich_tvm.compiler.artifact import export_with_layouts
from sandwich_tvm.compiler.phases import select_phase_kernels
from sandwich_tvm.model.config import PRESETS
from sandwich_tvm.model.linear import KernelSet


def _linear_kernels(mod, function: str) -> set[str]:
    return {gv.name_hint for gv in relax.analysis.all_global_vars(mod[function])
            if gv.name_hint.startswith("sandwich_linear_")}


def test_decode_functions_call_decode_kernels_after_the_pass():
    cfg = replace(PRESETS["llama-160m"], num_hidden_layers=1)
    kernels = KernelSet(prefill_threads=2, decode_threads=1, max_batch=4)
    mod, _, _ = export_with_layouts(cfg, kernels, "float32")
    before = {f: _linear_kernels(mod, f) for f in ("prefill", "decode", "batch_prefill", "batch_decode")}
    assert all(names and all("_prefill" in n for n in names) for names in before.values())  # the model file

    mod = select_phase_kernels(kernels)(mod)
    for f in ("prefill", "batch_prefill"):
        assert _linear_kernels(mod, f) == before[f]
    assert _linear_kernels(mod, "batch_decode") == {n.replace("_prefill", "_decode")
                                                    for n in before["batch_decode"]}
    assert _linear_kernels(mod, "decode") == {n.replace("_prefill", "_decode") + "_m1"
                                              for n in before["decode"]}
    for name in _linear_kernels(mod, "decode"):  # one variant: no dispatch on m
        assert str(mod[name].script()).count('T.sblock("v') == 1, name
    for name in _linear_kernels(mod, "batch_decode"):  # every bucket up to the batch
        assert str(mod[name].script()).count('T.sblock("v') > 1, name
    # one decode kernel per GEMM and epilogue, built for the decode plan's threads and batch
    assert {s for (phase, s) in kernels.sources if phase == "decode"} == {
        shape.name for shape, phase, _ in kernels.calls.values() if phase == "prefill"}
