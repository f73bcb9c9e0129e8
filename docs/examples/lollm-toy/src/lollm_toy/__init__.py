"""lollm-toy: an example third-party lollm family.

Two modules, read in this order:

* :mod:`lollm_toy.plugin`   – registers the family with lollm-core (plain data, no torch);
* :mod:`lollm_toy.modeling` – config, cache, model and ``load``, in one file.

Importing this package imports no torch.
"""

__version__ = "0.1.0"
