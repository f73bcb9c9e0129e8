"""The lollm plugin of this distribution: registers the families qwen3_5 and qwen3_5_moe.

lollm-core finds this module through the entry point declared in
pyproject.toml::

    [project.entry-points."lollm.families"]
    qwen3_5 = "lollm_qwen3_5.plugin"

and calls :func:`lollm_register_families` once per process. Everything here
is plain data read from each family's manifest (``qwen3_5/__init__.py``,
``qwen3_5_moe/__init__.py``); the loaders are named as ``"module:function"``
strings, so listing the installed families imports no torch and no model code.
"""

from lollm.family import CONTRACT_VERSION, Capabilities, Family
from lollm.hookspecs import hookimpl

from lollm_qwen3_5 import qwen3_5, qwen3_5_moe

# Both families: the chat template reads `enable_thinking` (--think / --no-think),
# checkpoints may carry an MTP head (mtp.*) for self-speculative decoding (--mtp),
# and every published checkpoint reads images (contract 3: the ViT in vision.py).
_CAPABILITIES = Capabilities(thinking_toggle=True, speculative_head=True, vision=True)


def families() -> list[Family]:
    """The Family records of this distribution, one per family."""
    return [
        Family(
            name="qwen3_5",
            contract=CONTRACT_VERSION,
            model_types=qwen3_5.MODEL_TYPES,
            load=qwen3_5.LOAD,
            gguf_architectures=qwen3_5.GGUF_ARCHITECTURES,
            sampling_defaults=dict(qwen3_5.SAMPLING_DEFAULTS),
            capabilities=_CAPABILITIES,
            vision=qwen3_5.VISION,
            description=qwen3_5.DESCRIPTION,
        ),
        Family(
            name="qwen3_5_moe",
            contract=CONTRACT_VERSION,
            model_types=qwen3_5_moe.MODEL_TYPES,
            load=qwen3_5_moe.LOAD,
            gguf_architectures=qwen3_5_moe.GGUF_ARCHITECTURES,
            sampling_defaults=dict(qwen3_5_moe.SAMPLING_DEFAULTS),
            capabilities=_CAPABILITIES,
            vision=qwen3_5_moe.VISION,
            description=qwen3_5_moe.DESCRIPTION,
        ),
    ]


@hookimpl
def lollm_register_families(register):
    """Register qwen3_5 and qwen3_5_moe (see :func:`lollm.hookspecs.lollm_register_families`)."""
    for family in families():
        register(family)
