"""Family ``gemma2``: Gemma 2 decoders (gemma-2-2b, 9b, 27b).

This file is the family's manifest: plain constants that the plugin
(``lollm_gemma.plugin``) reads without importing torch or any model code.

Read the family in this order: ``modeling_gemma2.py`` (the forward pass, top to
bottom) -> ``config.py`` (the numbers it reads) -> ``blocks.py`` -> ``kv.py`` ->
``weights.py``. The learner's pages are
docs/gemma2.md and docs/sliding-window.md (the cache).
"""

NAME = "gemma2"

#: config.json ``model_type`` values this family serves.
MODEL_TYPES = ("gemma2",)

#: GGUF ``general.architecture`` values this family serves (llama.cpp's converter;
#: name map, metadata keys and the +1 norm quirk in weights.py and config.py).
GGUF_ARCHITECTURES = ("gemma2",)

#: Gemma 2's generation_config.json names no sampling settings, so the family
#: gives none: lollm-core's defaults, the checkpoint's file and the user's flags apply.
SAMPLING_DEFAULTS: dict[str, float] = {}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_gemma.gemma2.weights:load"

DESCRIPTION = "Gemma 2 decoder: sandwich norms, GeGLU, attention and final logit soft-caps, alternating sliding/global layers"
