"""Family ``qwen2``: Qwen2 and Qwen2.5 dense decoders (e.g. Qwen2.5-0.5B-Instruct, Qwen2.5-Coder).

This file is the family's manifest: plain constants that the plugin
(``lollm_qwen.plugin``) reads without importing torch or any model code.

Read the family in this order: ``modeling_qwen2.py`` first (the model top to
bottom, its forward in numbered steps), ``config.py`` second (the numbers that
shape it), then ``blocks.py`` (the layers the model calls), ``kv.py`` and
``weights.py``. The learner's page is docs/qwen2.md.
"""

#: config.json ``model_type`` values this family serves.
MODEL_TYPES = ("qwen2",)

#: GGUF ``general.architecture`` values this family serves (name map and metadata
#: keys: weights.py ``GGUF_NAMES`` and config.py ``from_gguf``).
GGUF_ARCHITECTURES = ("qwen2",)

#: Sampling defaults from Qwen2.5's generation_config.json (Qwen2.5-7B-Instruct).
#: A checkpoint's own generation_config.json and the user's flags override them.
SAMPLING_DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_qwen.qwen2.weights:load"

DESCRIPTION = "Qwen2 / Qwen2.5 dense decoder: GQA with q/k/v bias, SwiGLU, RMSNorm, RoPE"
