"""Sandwich's kernel search plugged into MetaSchedule's own hooks, one module per concept.

- ``workload``: the Linear workload, its ``sandwich.gemm`` annotation, ``materialize``.
- ``schedule_rule``: ``SandwichGemmRule`` (a ``PyScheduleRule``), one design space per
  micro-kernel.
- ``search_strategy``: ``SandwichSearchStrategy`` (a ``PySearchStrategy``) running
  ``slice_search``.
- ``cache``: ``KernelCache``, one build per (shape, schedule), timed at any m.
- ``builder`` / ``runner``: ``InProcessBuilder`` / ``InProcessRunner`` (``PyBuilder`` /
  ``PyRunner``) build and time candidates in this process.
"""

from .builder import InProcessBuilder
from .cache import KernelCache
from .runner import InProcessRunner
from .schedule_rule import SandwichGemmRule
from .search_strategy import SandwichSearchStrategy
from .workload import ANNOTATION, BLOCK, annotate, linear_workload, materialize, schedule_of, workload_shape

__all__ = [
    "ANNOTATION", "BLOCK", "annotate", "linear_workload", "materialize", "schedule_of", "workload_shape",
    "SandwichGemmRule", "SandwichSearchStrategy", "KernelCache", "InProcessBuilder", "InProcessRunner",
]
