"""The lollm plugin of this distribution: registers the families qwen2 and qwen3.

lollm-core finds this module through the entry point declared in
pyproject.toml::

    [project.entry-points."lollm.families"]
    qwen = "lollm_qwen.plugin"

and calls :func:`lollm_register_families` once per process. Everything here
is plain data read from each family's manifest (``qwen2/__init__.py``,
``qwen3/__init__.py``); the loaders are named as ``"module:function"``
strings, so listing the installed families imports no torch and no model code.
"""

from lollm.family import CONTRACT_VERSION, Capabilities, Family
from lollm.hookspecs import hookimpl

from lollm_qwen import qwen2, qwen3


def families() -> list[Family]:
    """The Family records of this distribution, one per family."""
    return [
        Family(
            name="qwen2",
            contract=CONTRACT_VERSION,
            model_types=qwen2.MODEL_TYPES,
            load=qwen2.LOAD,
            gguf_architectures=qwen2.GGUF_ARCHITECTURES,
            sampling_defaults=dict(qwen2.SAMPLING_DEFAULTS),
            capabilities=Capabilities(),
            description=qwen2.DESCRIPTION,
        ),
        Family(
            name="qwen3",
            contract=CONTRACT_VERSION,
            model_types=qwen3.MODEL_TYPES,
            load=qwen3.LOAD,
            gguf_architectures=qwen3.GGUF_ARCHITECTURES,
            sampling_defaults=dict(qwen3.SAMPLING_DEFAULTS),
            # Qwen3's chat template reads `enable_thinking` (--think / --no-think).
            capabilities=Capabilities(thinking_toggle=True),
            description=qwen3.DESCRIPTION,
        ),
    ]


@hookimpl
def lollm_register_families(register):
    """Register qwen2 and qwen3 (see :func:`lollm.hookspecs.lollm_register_families`)."""
    for family in families():
        register(family)
