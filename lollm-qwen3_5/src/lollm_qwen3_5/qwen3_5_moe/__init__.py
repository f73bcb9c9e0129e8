"""Family ``qwen3_5_moe``: the Qwen3.5 / Qwen3.6 hybrid decoder with a sparse MoE FFN (e.g. Qwen3.5-35B-A3B, Qwen3.6-35B-A3B).

This file is the family's manifest: plain constants that the plugin
(``lollm_qwen3_5.plugin``) reads without importing torch or any model code.

Read the family in this order: ``modeling_qwen3_5_moe.py`` first (the model top
to bottom, its forward in numbered steps), ``config.py`` second (the numbers
that shape it), then ``blocks.py`` (the layers the model calls), ``kv.py``,
``mtp.py``, ``weights.py`` and ``fused_experts.py``. The learner's page is
docs/qwen3_5_moe.md (the backbone is explained in docs/qwen3_5.md).
"""

#: config.json ``model_type`` values this family serves: the multimodal
#: wrapper (``Qwen3_5MoeForConditionalGeneration``) and the text-only decoder.
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

#: GGUF ``general.architecture`` llama.cpp's converter writes for Qwen3.5 MoE (metadata:
#: config.py ``config_from_gguf``; tensors: gguf_weights.py).
GGUF_ARCHITECTURES = ("qwen35moe",)

#: No generation_config.json of a Qwen3.5 checkpoint was available when this
#: family was written, so it sets no sampling defaults of its own.
SAMPLING_DEFAULTS: dict = {}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_qwen3_5.qwen3_5_moe.weights:load"

#: ``module:function`` of the vision-tower loader (plugin contract 3: vision; docs/vision.md): the
#: ViT of a ``*ForConditionalGeneration`` checkpoint (``model.visual.*``); None for a text-only one.
#: Shared by qwen3_5 and qwen3_5_moe: their towers are the same (lollm_qwen3_5/vision.py).
VISION = "lollm_qwen3_5.vision_family:load_vision"

DESCRIPTION = (
    "Qwen3.5 / Qwen3.6 MoE hybrid decoder: Gated DeltaNet + gated attention (3:1), "
    "top-k routed experts + gated shared expert; MTP draft head"
)
