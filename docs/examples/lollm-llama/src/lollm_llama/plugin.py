"""The lollm plugin of this distribution: registers the family ``llama``.

lollm-core finds this module through the entry point in pyproject.toml
(``[project.entry-points."lollm.families"]``) and calls
:func:`lollm_register_families` once per process. Everything here is plain data
from the family's manifest (``llama/__init__.py``): listing the installed
families imports no torch and no model code.
"""

from lollm.family import Capabilities, Family
from lollm.hookspecs import hookimpl

from lollm_llama import llama

FAMILY = Family(
    name="llama",
    # the plugin contract this family is written for: 2, load(checkpoint, options) (docs/plugins.md,
    # section 4); a lollm-core that speaks another refuses it, saying what changed
    contract=2,
    model_types=llama.MODEL_TYPES,
    load=llama.LOAD,
    gguf_architectures=llama.GGUF_ARCHITECTURES,
    sampling_defaults=dict(llama.SAMPLING_DEFAULTS),
    capabilities=Capabilities(),
    parity_reference=llama.PARITY_REFERENCE,
    description=llama.DESCRIPTION,
)


@hookimpl
def lollm_register_families(register):
    """Register the family (see :func:`lollm.hookspecs.lollm_register_families`)."""
    register(FAMILY)
