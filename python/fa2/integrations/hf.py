"""fa2 as a Hugging Face transformers (5.x) attention implementation:

    import fa2
    fa2.hf.register()                                                    # once, before building the model
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa2")   # or .from_pretrained(...)

register() adds two entries under one name: the attention function (AttentionInterface) and a mask
function (AttentionMaskInterface). The mask function is the one transformers uses for flash-attention: no
mask for plain causal or full attention (nothing of size seqlen_q x seqlen_k is built), else the 2-D
(batch, seqlen_k) padding mask, which the attention function turns into one varlen call. Sequences packed
into one row (batch 1, position_ids restarting at each sequence) also run as varlen, as with flash-attn.

Sliding-window layers (Mistral, Qwen2, Gemma 2/3, gpt-oss), logit softcapping (Gemma 2) and attention sinks
(gpt-oss) run in fa2's kernels, from the `sliding_window`, `softcap` and `s_aux` arguments the models pass.
Attention dropout runs in the kernels too. What fa2 cannot do raises NotImplementedError instead of being
ignored: position biases, chunked attention, arbitrary 4-D masks and custom mask overlays.
transformers is imported only inside register(): importing fa2 never imports it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fa2.ops import attention, attention_varlen

NAME = "fa2"


def register(name: str = NAME) -> str:
    """Make `name` a valid attn_implementation for every transformers model. Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    return name


def build_mask(*, mask_function=None, attention_mask=None, local_size=None, use_vmap=False, **kwargs):
    """The mask-interface entry: None, or the 2-D boolean padding mask (transformers' flash-attention mask)."""
    from transformers.masking_utils import flash_attention_mask

    # A sliding layer (local_size) gets its window in the attention call (the sliding_window argument); chunked
    # layers are refused there (_reject_unsupported).
    # fa2 runs causal or full attention cut down by padding or packing (and_masks). A union with another pattern
    # (or_masks: e.g. image tokens that see each other both ways) or a model's own overlay (use_vmap) is more.
    if use_vmap or getattr(mask_function, "__name__", "") == "or_mask":
        raise NotImplementedError("fa2 supports causal or full attention with padding only, not this model's custom "
                                  "mask overlay: use attn_implementation='sdpa'")
    if local_size is not None:
        kwargs["local_size"] = local_size  # transformers cuts the padding mask to a sliding layer's keys
    return flash_attention_mask(mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def _reject_unsupported(module, attention_mask, kwargs: dict) -> None:
    if getattr(getattr(module, "config", None), "attention_chunk_size", None) is not None:
        raise NotImplementedError("fa2 has no chunked attention (the config's attention_chunk_size): use "
                                  "attn_implementation='sdpa' for this model")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("fa2 does not support position_bias, which this model passes: use "
                                  "attn_implementation='sdpa'")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"fa2 takes a padding mask (batch, seqlen_k) only, got a mask of shape "
                                  f"{tuple(attention_mask.shape)}: pass a 2-D attention_mask, or use 'sdpa'")


def _unpad(x: torch.Tensor, keep: torch.Tensor):
    """(batch, seqlen, heads, dim) -> the kept tokens packed (tokens, heads, dim), their flat indices,
    cu_seqlens and max_seqlen. Host sync: the token count sets the output shape."""
    lens = keep.sum(dim=1, dtype=torch.int32)
    index = keep.flatten().nonzero().flatten()
    cu_seqlens = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:])[index], index, cu_seqlens, int(lens.max())


def _packed(q: torch.Tensor, k: torch.Tensor, kwargs: dict):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of sequences packed along the seqlen dim, or
    None. Given by the caller (transformers' FlashAttentionKwargs cu_seq_lens_q, ...), or read off
    position_ids as transformers' flash-attention path does: batch 1, no cache, positions that restart."""
    if kwargs.get("cu_seq_lens_q") is not None:
        names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
        cu_q, cu_k, max_q, max_k = (kwargs[name] for name in names)
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    position_ids, seqlen = kwargs.get("position_ids"), q.shape[1]
    if position_ids is None or q.shape[0] != 1 or k.shape[1] != seqlen or position_ids.numel() != seqlen:
        return None
    pos = position_ids.reshape(-1)
    starts = torch.cat([pos.new_ones(1, dtype=torch.bool), pos[1:] != pos[:-1] + 1])
    # A host sync (and a graph break under torch.compile), as in transformers' flash-attention path.
    if not starts[1:].any():
        return None
    cu_seqlens = F.pad(starts.nonzero().flatten().to(torch.int32), (0, 1), value=seqlen)
    max_seqlen = int(cu_seqlens.diff().max())
    return cu_seqlens, cu_seqlens, max_seqlen, max_seqlen


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """The AttentionInterface entry. query: (batch, nheads, seqlen_q, head_dim); key, value: (batch, nheads_k,
    seqlen_k, head_dim), fewer heads for GQA/MQA (fa2 reads them directly: no repeat). attention_mask: None or
    a boolean (batch, seqlen_k) padding mask. Returns (out (batch, seqlen_q, nheads, head_dim), None)."""
    _reject_unsupported(module, attention_mask, kwargs)
    causal = module.is_causal if is_causal is None else is_causal
    options = dict(causal=causal, softmax_scale=scaling, deterministic=bool(kwargs.get("deterministic")),
                   softcap=kwargs.get("softcap") or 0.0, sink=kwargs.get("s_aux"))
    if dropout:  # the models pass their attention dropout only while training
        options["dropout_p"] = float(dropout)
    if kwargs.get("sliding_window") is not None:
        # transformers' sliding window: query i sees keys j > i - sliding_window (masking_utils'
        # sliding_window_overlay), sliding_window - 1 to the left, as its flash-attention path passes it.
        width = int(kwargs["sliding_window"]) - 1
        options["window_size"] = (width, 0 if causal else width)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # fa2's layout: (batch, seqlen, heads, dim)
    batch, seqlen_q, nheads, head_dim = q.shape
    if attention_mask is not None:
        # A static cache holds more key slots than the mask covers; the slots past the mask are unused.
        k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]
        # The queries are the last seqlen_q keys, so their padding is the mask's last seqlen_q columns.
        q_, index_q, cu_q, max_q = _unpad(q, attention_mask[:, -seqlen_q:])
        k_, index_k, cu_k, max_k = _unpad(k, attention_mask)
        v_ = v.reshape(-1, *v.shape[2:])[index_k]
        out_ = attention_varlen(q_, k_, v_, cu_q, cu_k, max_q, max_k, **options)
        out = out_.new_zeros(batch * seqlen_q, nheads, head_dim).index_copy(0, index_q, out_)  # padding rows: 0
        return out.view(batch, seqlen_q, nheads, head_dim), None
    packed = _packed(q, k, kwargs)
    if packed is not None:
        q_, k_, v_ = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out = attention_varlen(q_, k_, v_, *packed, **options)
        return out.view(batch, seqlen_q, nheads, head_dim), None
    return attention(q, k, v, **options), None
