"""fa2 where existing code already calls attention. Each module imports fa2's core (fa2.ops), never the package root:

    fa2.integrations.flash_attn   flash_attn_func / flash_attn_varlen_func, flash-attn 2.x's signatures
    fa2.integrations.hf           fa2 as a transformers attention implementation (attn_implementation="fa2")
    fa2.integrations.sdpa         fa2 behind F.scaled_dot_product_attention (torch's flash-attention registry)

`import fa2` imports all three (they are light: transformers is imported only by hf.register()) and exposes them as
fa2.flash_attn_func, fa2.hf and fa2.sdpa."""
