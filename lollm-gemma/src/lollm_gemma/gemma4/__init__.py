"""Family ``gemma4``: the Gemma 4 text decoder (gemma-4-E2B, E4B and dense siblings).

This file is the family's manifest: plain constants that the plugin
(``lollm_gemma.plugin``) reads without importing torch or any model code.

Read the family in this order: ``modeling_gemma4.py`` (the forward pass, top to
bottom) -> ``config.py`` (the numbers it reads; ``config_gguf.py`` from a GGUF file) -> ``blocks.py`` -> ``kv.py`` ->
``weights.py``, ``shared_kv_names.py``; then images in: ``../gemma4_vision_contract.py`` (the
tower as core drives it) -> ``../gemma4_vision.py`` -> ``../gemma4_vision_preprocess.py``. The learner's pages are
docs/gemma4.md (what changed since Gemma 3) and docs/sliding-window.md (the cache).
"""

NAME = "gemma4"

#: config.json ``model_type`` values this family serves: ``gemma4_text``
#: (Gemma4ForCausalLM) and ``gemma4`` (Gemma4ForConditionalGeneration: the language model
#: by LOAD, the vision tower by VISION when images are given; the audio tower is skipped).
MODEL_TYPES = ("gemma4_text", "gemma4")

#: GGUF ``general.architecture`` values this family serves (llama.cpp's converter; see weights.py).
GGUF_ARCHITECTURES = ("gemma4",)

#: Sampling defaults from gemma-4-E2B-it's generation_config.json.
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_gemma.gemma4.weights:load"

#: ``module:function`` of the vision-tower loader (plugin contract 3: vision; docs/vision.md): the
#: vision encoder and projector of a ``gemma4`` checkpoint, None for ``gemma4_text``.
VISION = "lollm_gemma.gemma4_vision_contract:load_vision"

DESCRIPTION = "Gemma 4 text decoder: per-layer embeddings, shared KV layers, proportional RoPE, per-layer head dims"
