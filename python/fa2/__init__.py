"""fa2: FlashAttention-2 forward and backward on CuTe mma.sync kernels.

    out = fa2.attention(q, k, v, causal=True)          # autograd-aware, (batch, seqlen, nheads, head_dim)
    out, lse = fa2.fwd(q, k, v, causal=True)           # low level
    dq, dk, dv = fa2.bwd(dout, q, k, v, out, lse, causal=True)
"""
from fa2 import reference
from fa2.interface import attention, build_info, bwd, fwd

__version__ = "0.1.0"
__all__ = ["attention", "build_info", "bwd", "fwd", "reference", "__version__"]
