"""Family ``qwen3``: Qwen3 dense decoders (e.g. Qwen3-0.6B, Qwen3-4B).

This file is the family's manifest: plain constants that the plugin
(``lollm_qwen.plugin``) reads without importing torch or any model code.

Qwen3 is qwen2 with three changes: no q/k/v bias (unless ``attention_bias``),
an RMSNorm over ``head_dim`` on every query and key head before RoPE
("QK-norm"), and ``head_dim`` given explicitly in config.json. The family is
written out in full anyway (it never imports qwen2), so it reads on its own.

Read it in this order: ``modeling_qwen3.py`` first (the model top to bottom,
its forward in numbered steps), ``config.py`` second (the numbers that shape
it), then ``blocks.py`` (the layers the model calls), ``kv.py`` and
``weights.py``. The learner's page is docs/qwen3.md.
"""

#: config.json ``model_type`` values this family serves.
MODEL_TYPES = ("qwen3",)

#: GGUF ``general.architecture`` values this family serves (name map and metadata
#: keys: weights.py ``GGUF_NAMES`` and config.py ``from_gguf``).
GGUF_ARCHITECTURES = ("qwen3",)

#: Sampling defaults from Qwen3's generation_config.json (Qwen3-4B; thinking mode).
#: A checkpoint's own generation_config.json and the user's flags override them.
SAMPLING_DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.0,
}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_qwen.qwen3.weights:load"

DESCRIPTION = "Qwen3 dense decoder: GQA with QK-norm, no q/k/v bias, SwiGLU, RMSNorm, RoPE"
