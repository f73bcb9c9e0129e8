"""Moved to :mod:`lollm.cli.real_models` (``lollm list``/``pull`` read it, and production never imports ``testing/``).

This old name stays importable until lollm-core 0.3 (docs/plugins.md, "Names that moved"): importing
it gives the module at its new place, the same object (so monkeypatching either name patches both),
with a DeprecationWarning naming the new one. ``python -m lollm.testing.real_models`` still runs
its command line.
"""

from __future__ import annotations

import sys
import warnings

from lollm.cli import real_models as _moved_to

if __name__ == "__main__":  # python -m lollm.testing.real_models: the command line of the new module
    sys.exit(_moved_to.main())
warnings.warn("lollm.testing.real_models moved to lollm.cli.real_models (core by layers, lollm 0.2); the old name goes in 0.3",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved_to
