"""The lollm plugin of this distribution: registers the families gemma2, gemma3 and gemma4.

lollm-core finds this module through the entry point declared in
pyproject.toml::

    [project.entry-points."lollm.families"]
    gemma = "lollm_gemma.plugin"

and calls :func:`lollm_register_families` once per process. Everything here
is plain data read from each family's manifest (``gemma2/__init__.py`` …);
the loaders are named as ``"module:function"`` strings, so listing the
installed families imports no torch and no model code.
"""

from lollm.family import CONTRACT_VERSION, Capabilities, Family
from lollm.hookspecs import hookimpl

from lollm_gemma import gemma2, gemma3, gemma4


def families() -> list[Family]:
    """The Family records of this distribution, one per family."""
    return [
        Family(
            name=manifest.NAME,
            contract=CONTRACT_VERSION,
            model_types=manifest.MODEL_TYPES,
            load=manifest.LOAD,
            gguf_architectures=manifest.GGUF_ARCHITECTURES,
            sampling_defaults=dict(manifest.SAMPLING_DEFAULTS),
            capabilities=Capabilities(vision=getattr(manifest, "VISION", None) is not None),
            description=manifest.DESCRIPTION,
            vision=getattr(manifest, "VISION", None),  # contract 3: vision (a manifest without VISION: text only)
        )
        for manifest in (gemma2, gemma3, gemma4)
    ]


@hookimpl
def lollm_register_families(register):
    """Register gemma2, gemma3 and gemma4 (see :func:`lollm.hookspecs.lollm_register_families`)."""
    for family in families():
        register(family)
