"""Family ``qwen3_5``: the Qwen3.5 / Qwen3.6 dense hybrid decoder (e.g. Qwen3.5-0.8B, Qwen3.5-27B).

This file is the family's manifest: plain constants that the plugin
(``lollm_qwen3_5.plugin``) reads without importing torch or any model code.

Read the family in this order: ``modeling_qwen3_5.py`` first (the model top to
bottom, its forward in numbered steps), ``config.py`` second (the numbers that
shape it), then ``blocks.py`` (the layers the model calls), ``kv.py``,
``mtp.py`` and ``weights.py``. The learner's page is docs/qwen3_5.md.
"""

#: config.json ``model_type`` values this family serves: the multimodal
#: wrapper (``Qwen3_5ForConditionalGeneration``, decoder under ``text_config``)
#: and the text-only decoder (``Qwen3_5ForCausalLM``).
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

#: GGUF ``general.architecture`` llama.cpp's converter writes for Qwen3.5 dense (metadata:
#: config.py ``config_from_gguf``; tensors: gguf_weights.py).
GGUF_ARCHITECTURES = ("qwen35",)

#: No generation_config.json of a Qwen3.5 checkpoint was available when this
#: family was written, so it sets no sampling defaults of its own: a real
#: checkpoint's generation_config.json and the user's flags decide.
SAMPLING_DEFAULTS: dict = {}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_qwen3_5.qwen3_5.weights:load"

#: ``module:function`` of the vision-tower loader (plugin contract 3: vision; docs/vision.md): the
#: ViT of a ``*ForConditionalGeneration`` checkpoint (``model.visual.*``); None for a text-only one.
#: Shared by qwen3_5 and qwen3_5_moe: their towers are the same (lollm_qwen3_5/vision.py).
VISION = "lollm_qwen3_5.vision_family:load_vision"

DESCRIPTION = (
    "Qwen3.5 / Qwen3.6 dense hybrid decoder: Gated DeltaNet + gated attention (3:1), "
    "partial RoPE, (1+w) RMSNorm, SwiGLU; MTP draft head"
)
