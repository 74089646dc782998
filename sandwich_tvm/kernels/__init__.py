"""Dynamic-shape GEMM generation (paper §6): micro-kernels, TensorIR generation, search.

Public entry points for other TVM flows:

- ``SandwichGemmRule`` / ``SandwichSearchStrategy``: MetaSchedule schedule rule and search
  strategy for the Linear pattern on a packed weight (``metaschedule.schedule_rule``,
  ``metaschedule.search_strategy``; builder, runner and workload beside them).
- ``tune_gemm(n, k, threads=...)``: tune every sequence length of one GEMM (``tuner``).
- ``linear_primfunc(shape, buckets)``: the generated dynamic-m kernel (``codegen``);
  ``WeightLayout(isa, dtype).pack(w)`` (``packing``) puts a weight in the layout it reads.
- ``kernel_isa(isa, dtype, flags)``: which micro-kernels serve weights of a dtype on a CPU
  (bf16 on AVX512-BF16: ``vdpbf16ps``; else widened to fp32 as loaded).
"""

from .codegen import Bucket, KernelError, linear_primfunc, linear_source, pack_weight, packed_panels
from .database import KernelRecord, ScheduleDbError, find_record, load_record, save_record
from .microkernel import ISAS, REGISTRY, MicroKernel, enumerate_microkernels, kernel_isa, microkernels
from .packing import WeightLayout
from .schedule import GemmSchedule, GemmShape, Polymerization, Slice, polymerizations
from .search import Problem, SequenceTuner, fast_start, finetune, run_search, slice_search

__all__ = [
    "Bucket", "KernelError", "linear_primfunc", "linear_source", "pack_weight", "packed_panels",
    "KernelRecord", "ScheduleDbError", "find_record", "load_record", "save_record",
    "ISAS", "REGISTRY", "MicroKernel", "enumerate_microkernels", "kernel_isa", "microkernels",
    "WeightLayout",
    "GemmSchedule", "GemmShape", "Polymerization", "Slice", "polymerizations",
    "Problem", "SequenceTuner", "fast_start", "finetune", "run_search", "slice_search",
]
