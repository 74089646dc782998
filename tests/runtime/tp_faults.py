"""A tensor-parallel worker with one more rank function, which fails on a chosen rank (for
``test_tp_ranks``): ``python -m tests.runtime.tp_faults`` from the repository root."""

from __future__ import annotations

import numpy as np

from sandwich_tvm.runtime import tp_worker
from sandwich_tvm.runtime.disco_group import rank_function

ENTRYPOINT = "tests.runtime.tp_faults"
FAIL_ON = "sandwich.test.fail_on"  # (bad rank) -> the sum of one per rank, or a failure


@rank_function(FAIL_ON)
def _fail_on(rank: tp_worker.Rank, bad: int) -> float:
    if rank.rank == bad:
        raise ValueError(f"injected on rank {bad}")
    return float(rank.group.allreduce(np.ones(1, np.float32))[0])  # waits for every rank


if __name__ == "__main__":
    tp_worker.main()
