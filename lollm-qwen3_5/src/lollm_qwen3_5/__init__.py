"""lollm-qwen3_5: the lollm families ``qwen3_5`` and ``qwen3_5_moe``.

Qwen3.5 and Qwen3.6 are *hybrid* decoders: three of every four layers mix
tokens with Gated DeltaNet (a linear-attention layer with a fixed-size
recurrent state), the fourth with ordinary (gated) softmax attention. The
``_moe`` variant replaces the dense MLP with a sparse mixture of experts.

Layout (each family folder reads on its own; qwen3_5_moe never imports qwen3_5)::

    plugin.py              registers both families with lollm-core (no torch import)
    qwen3_5/ , qwen3_5_moe/
      __init__.py          manifest: model types, GGUF architectures, sampling defaults
      config.py            <Family>Config from config.json (text-only and multimodal layouts)
      blocks.py            RMSNorm, partial RoPE, gated attention, Gated DeltaNet and the
                           two forms of the delta rule, MLP (or the MoE block)
      modeling_<f>.py      DecoderLayer + ForCausalLM, forward in numbered steps
      kv.py                the hybrid cache: K/V for attention layers, (conv, recurrent)
                           state for DeltaNet layers, rollback for speculative decoding
      mtp.py               the multi-token-prediction (MTP) draft head
      weights.py           name maps (text-only, multimodal, fused/per-expert MoE), ``load``

Importing this package imports no torch: the model code is imported only
when a model is loaded.
"""

__version__ = "0.1.0"
