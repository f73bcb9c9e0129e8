"""Family ``llama``: Llama 2 and Llama 3.x dense decoders (Llama-2-7b, Llama-3.1-8B, Llama-3.2-1B ...).

This file is the family's manifest: plain constants that the plugin
(``lollm_llama.plugin``) reads without importing torch or any model code.

The family was made with ``lollm new-family llama --like qwen2`` and then
adapted (docs/plugins.md walks through every change; docs/llama.md is the
learner's page). Read it in this order: ``modeling_llama.py`` first (the model
top to bottom, its forward in numbered steps), ``config.py`` second (the numbers
that shape it), then ``blocks.py`` (the layers the model calls), ``kv.py``,
``weights.py`` and ``parity.py``.
"""

#: config.json ``model_type`` values this family serves.
MODEL_TYPES = ("llama",)

#: GGUF ``general.architecture`` values this family serves (name map and metadata
#: keys: weights.py ``GGUF_NAMES`` and config.py ``from_gguf``).
GGUF_ARCHITECTURES = ("llama",)

#: Sampling defaults from Llama 3's generation_config.json (Llama-3.1-8B-Instruct:
#: temperature 0.6, top_p 0.9). A checkpoint's own generation_config.json and the
#: user's flags override them.
SAMPLING_DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.9,
}

#: ``module:function`` of the loader, imported only when a model is loaded.
LOAD = "lollm_llama.llama.weights:load"

DESCRIPTION = "Llama 2 / Llama 3.x decoder: GQA, SwiGLU, RMSNorm, RoPE (llama3 scaling), optional biases"

#: Each model type of this family -> the transformers model type whose math it follows
#: (the same here: transformers knows ``llama``; parity.py builds its LlamaForCausalLM).
REFERENCE_MODEL_TYPES = {"llama": "llama"}

#: ``module:function`` of the parity reference (``lollm parity`` and the conformance kit call it).
PARITY_REFERENCE = "lollm_llama.llama.parity:reference"
