"""fa2: FlashAttention-2 forward and backward for PyTorch, on CuTe mma.sync kernels.

    out = fa2.attention(q, k, v, causal=True)          # autograd-aware, (batch, seqlen, nheads, head_dim)
    out, lse = fa2.fwd(q, k, v, causal=True)           # low level
    dq, dk, dv = fa2.bwd(dout, q, k, v, out, lse, causal=True)
    out = fa2.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # packed
    out = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)  # decode: append, then attend
    from fa2 import flash_attn_func                    # drop-in for flash-attn 2.x
    fa2.hf.register()                                  # attn_implementation="fa2" in transformers
    fa2.sdpa.activate()                                # fa2 behind F.scaled_dot_product_attention
    fa2.testing.check_attention(out, q, k, v, causal=True)  # the tests' 2x rule; after `import fa2.testing`
"""
import os
import warnings
from importlib import metadata

import torch  # noqa: F401  (first: fa2._C links libtorch, which torch's import loads)

from fa2 import reference
from fa2.integrations import hf, sdpa  # sdpa's import registers "fa2" with torch's flash-attention registry
from fa2.integrations.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                         flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                         flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from fa2.interface import build_info, bwd, bwd_varlen, fwd, fwd_varlen
from fa2.kvcache import attention_with_kvcache
from fa2.ops import attention, attention_varlen

__version__ = "0.1.0"
__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "build_info", "bwd", "bwd_varlen",
           "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "fwd",
           "fwd_varlen", "hf", "reference", "sdpa", "__version__"]


def _warn_if_another_distribution_shares_this_directory() -> None:
    # pip removes only the files of the distribution it replaces. Another distribution named `fa2` (this project's
    # builds before it was named fa2-cute, or PyPI's unrelated `fa2`) leaves its modules beside ours, and
    # `import fa2.<its module>` then loads code that does not belong to this package.
    try:
        other = metadata.distribution("fa2")
    except metadata.PackageNotFoundError:
        return
    if os.path.realpath(str(other.locate_file("fa2/__init__.py"))) == os.path.realpath(__file__):
        warnings.warn(f"the distribution fa2 {other.version} is installed in the same place as fa2-cute and its files "
                      "may shadow fa2's modules: run `pip uninstall fa2 fa2-cute`, then install fa2-cute again",
                      stacklevel=2)


_warn_if_another_distribution_shares_this_directory()
