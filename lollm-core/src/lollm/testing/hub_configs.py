"""Moved to :mod:`lollm.cli.hub_configs` (``lollm new-family`` reads it, and production never imports ``testing/``).

This old name stays importable until lollm-core 0.3 (docs/plugins.md, "Names that moved"): importing
it gives the module at its new place, the same object (so monkeypatching either name patches both),
with a DeprecationWarning naming the new one.
"""

from __future__ import annotations

import sys
import warnings

from lollm.cli import hub_configs as _moved_to

warnings.warn("lollm.testing.hub_configs moved to lollm.cli.hub_configs (core by layers, lollm 0.2); the old name goes in 0.3",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved_to
