"""lollm-gemma: the lollm families ``gemma2``, ``gemma3`` and ``gemma4`` (text decoder).

Layout (each family folder reads on its own; none imports another)::

    plugin.py            registers the three families with lollm-core (no torch import)
    gemma2/ , gemma3/ , gemma4/
      __init__.py        manifest: model types, GGUF architectures, sampling defaults
      config.py          <Family>Config from config.json (hub and transformers-5 schemas)
      blocks.py          RMSNorm, RoPE, attention (sliding window / global), GeGLU MLP
      modeling_<f>.py    DecoderLayer + ForCausalLM, forward in numbered steps
      kv.py              the cache: a ring buffer per sliding layer, a full cache per global layer
      weights.py         name maps per format, tied embeddings, ``load``

Importing this package imports no torch: the model code is imported only
when a model is loaded.
"""

__version__ = "0.1.0"
