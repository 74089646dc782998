"""RMSNorm as a Relax module calling the generated kernel (``kernels.norm``)."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels.norm import rms_norm_primfunc


class RMSNorm(nn.Module):
    """Drop-in for ``nn.RMSNorm`` (same parameter name) calling the generated kernel."""

    def __init__(self, hidden: int, eps: float, dtype: str = "float32", isa: str | None = None):
        self.hidden, self.eps, self.isa = hidden, eps, isa
        self.weight = nn.Parameter((hidden,), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        lead = list(x.shape[:-1])
        x2 = op.reshape(x, (-1, self.hidden))
        func = rms_norm_primfunc(self.hidden, float(self.eps), self.isa)
        y = op.tensor_ir_op(func, f"rms_norm_h{self.hidden}", args=[x2, self.weight],
                            out=nn.Tensor.placeholder((x2.shape[0], self.hidden), x.dtype))
        return op.reshape(y, (*lead, self.hidden))
