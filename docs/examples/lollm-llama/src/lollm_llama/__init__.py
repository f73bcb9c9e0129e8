"""lollm-llama: the lollm family ``llama`` (made with ``lollm new-family llama --like qwen2``).

    plugin.py     registers the family with lollm-core (no torch import)
    llama/       the family: manifest (__init__.py), config, blocks, modeling, kv cache, weights, parity

Importing this package imports no torch: the model code is imported only when a model is loaded.
"""

__version__ = "0.1.0"
