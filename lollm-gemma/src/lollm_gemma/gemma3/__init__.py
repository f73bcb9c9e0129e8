"""Family ``gemma3``: Gemma 3 text decoders (Gemma 3 270M, 1B; the language model of 4B, 12B, 27B).

This file is the family's manifest: plain constants that the plugin
(``lollm_gemma.plugin``) reads without importing torch or any model code.

Read the family in this order: ``modeling_gemma3.py`` (the forward pass, top to
bottom) -> ``config.py`` (the numbers it reads) -> ``blocks.py`` -> ``kv.py`` ->
``weights.py``; then ``vision.py`` (images in). The learner's pages are
docs/gemma3.md (what changed since Gemma 2) and docs/sliding-window.md (the cache).
"""

NAME = "gemma3"

#: config.json ``model_type`` values this family serves:
#: ``gemma3_text`` (Gemma3ForCausalLM: 270M, 1B) and ``gemma3`` (Gemma3ForConditionalGeneration:
#: 4B, 12B, 27B; the language model by LOAD, the vision tower by VISION when images are given).
MODEL_TYPES = ("gemma3_text", "gemma3")

#: GGUF ``general.architecture`` values this family serves (llama.cpp's converter;
#: name map, metadata keys and the +1 norm quirk in weights.py and config.py).
GGUF_ARCHITECTURES = ("gemma3",)

#: Sampling defaults from Gemma 3's generation_config.json (gemma-3-270m-it, gemma-3-4b-it).
#: A checkpoint's own generation_config.json and the user's flags override them.
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_gemma.gemma3.weights:load"

#: ``module:function`` of the vision-tower loader (plugin contract 3: vision; docs/vision.md): the
#: SigLIP tower and projector of a ``gemma3`` checkpoint (4B, 12B, 27B), None for ``gemma3_text``.
VISION = "lollm_gemma.gemma3.vision:load_vision"

DESCRIPTION = "Gemma 3 text decoder: sandwich norms, QK-norm, GeGLU, 5:1 sliding-window/global layers, two RoPE bases"
