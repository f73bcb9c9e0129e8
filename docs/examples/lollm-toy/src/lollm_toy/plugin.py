"""The lollm plugin of lollm-toy: registers the family ``lollm_toy``.

lollm-core finds this module through the entry point in pyproject.toml::

    [project.entry-points."lollm.families"]
    toy = "lollm_toy.plugin"

and calls :func:`lollm_register_families` once per process. This module
imports only lollm's contract (no torch, no model code): the loader is named
by a ``"module:function"`` string and imported only when a model is loaded,
so ``lollm families`` stays fast.
"""

from lollm.family import CONTRACT_VERSION, Capabilities, Family
from lollm.hookspecs import hookimpl

FAMILY = Family(
    name="lollm_toy",
    contract=CONTRACT_VERSION,
    model_types=("lollm_toy",),
    load="lollm_toy.modeling:load",
    # a checkpoint's generation_config.json and the user's flags override these
    sampling_defaults={"temperature": 0.8, "top_k": 40},
    capabilities=Capabilities(),  # no chat thinking toggle, no draft head
    description="example family: a tiny GPT-style decoder with learned positions",
)


@hookimpl
def lollm_register_families(register):
    """Register the toy family (see :func:`lollm.hookspecs.lollm_register_families`)."""
    register(FAMILY)
