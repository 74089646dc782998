"""A rank module whose pipeline exchanges lie (for ``test_pipeline_hosts``): it answers every
relayed step with an exchange of the wrong shape."""

from __future__ import annotations

import numpy as np
import tvm_ffi

from sandwich_tvm.runtime import relay, tp_worker


def _lie(*_args) -> bytes:
    return relay.pack(relay.GATHER, np.zeros((1, 3), np.float32))


for _name in (tp_worker.RELAY_PREFILL, tp_worker.RELAY_DECODE, tp_worker.RELAY_RESUME):
    tvm_ffi.register_global_func(_name, _lie, override=True)

if __name__ == "__main__":
    tp_worker.main()
