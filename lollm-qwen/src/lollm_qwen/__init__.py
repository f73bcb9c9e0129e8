"""lollm-qwen: the lollm families ``qwen2`` and ``qwen3``.

Layout (each family folder reads on its own; qwen3 never imports qwen2)::

    plugin.py            registers both families with lollm-core (no torch import)
    qwen2/ , qwen3/
      __init__.py        manifest: model types, GGUF architectures, sampling defaults
      config.py          <Family>Config from config.json (hub and transformers-5 schemas)
      blocks.py          RMSNorm, RoPE, attention, SwiGLU MLP
      modeling_<f>.py    DecoderLayer + ForCausalLM, forward in numbered steps
      kv.py              the preallocated KV cache
      weights.py         name maps per format, tied embeddings, ``load``

Importing this package imports no torch: the model code is imported only
when a model is loaded.
"""

__version__ = "0.1.0"
