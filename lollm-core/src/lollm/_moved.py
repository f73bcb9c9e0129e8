"""Old module names of the flat core, still importable until the next minor version (0.3).

Core moved from one flat package into layers (``load/``, ``generate/``, ``engine/``,
``serve/``, ``proof/``, ``cli/``; docs/architecture.md). A third-party family written
against 0.2 may still say ``from lollm.options import LoadOptions``: the finder below
answers such an import with the module at its new place, the same module object (so
``isinstance`` and monkeypatching agree), and a :class:`DeprecationWarning` naming the new
name. docs/plugins.md lists the same table.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module name -> where it lives now
MOVED = {
    "lollm.loader": "lollm.load.loader",
    "lollm.pipeline": "lollm.load.pipeline",
    "lollm.options": "lollm.load.options",
    "lollm.build": "lollm.load.build",
    "lollm.weights": "lollm.load.weights",
    "lollm.quantized": "lollm.load.quantized",
    "lollm.inventory": "lollm.cli.inventory",
    "lollm.checks": "lollm.load.checks",
    "lollm.plugins": "lollm.load.plugins",
    "lollm.tensor_parallel": "lollm.load.tensor_parallel",
    "lollm.ranks": "lollm.load.ranks",
    "lollm.threads": "lollm.load.threads",
    "lollm.sampling": "lollm.generate.sampling",
    "lollm.structured": "lollm.generate.structured",
    "lollm.drafting": "lollm.generate.drafting",
    "lollm.prompt_cache": "lollm.generate.prompt_cache",
    "lollm.prefill": "lollm.generate.prefill",
    "lollm.memory": "lollm.generate.memory",
    "lollm.conversation": "lollm.generate.conversation",
    "lollm.llm": "lollm.engine.llm",
    "lollm.serving_engine": "lollm.engine.driver",
    "lollm.server": "lollm.serve.server",
    "lollm.serving_metrics": "lollm.serve.metrics",
    "lollm.tools": "lollm.serve.tools",
    "lollm.cli_batch": "lollm.cli.batch",
    "lollm.cli_checks": "lollm.cli.checks",
    "lollm.cli_inputs": "lollm.cli.inputs",
    "lollm.cli_options": "lollm.cli.options",
    "lollm.cli_report": "lollm.cli.report",
    "lollm.models": "lollm.cli.models",
    "lollm.new_family": "lollm.cli.new_family",
    "lollm.bench": "lollm.proof.bench",
    "lollm.bench_batching": "lollm.proof.bench_batching",
    "lollm.parity": "lollm.proof.parity",
    "lollm.trace.run": "lollm.cli.trace.run",
    "lollm.trace.page": "lollm.cli.trace.page",
    # moved again in 0.2: not loading, so into the commands layer
    "lollm.load.real_models": "lollm.cli.real_models",
    "lollm.load.hub_configs": "lollm.cli.hub_configs",
    "lollm.load.inventory": "lollm.cli.inventory",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta path finder that imports each old name in :data:`MOVED` as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new} (core by layers, lollm 0.2); the old name goes in 0.3",
                      DeprecationWarning, stacklevel=4)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: :meth:`create_module` gave the new module, already executed."""

    def get_code(self, fullname: str) -> types.CodeType:
        """``python -m OLD`` (runpy asks the loader for the code to run): warn, then run the new module as ``__main__``."""
        new = MOVED[fullname]
        message = f"{fullname} moved to {new} (core by layers, lollm 0.2); the old name goes in 0.3"
        source = ("import runpy, warnings\n"
                  f"warnings.warn({message!r}, DeprecationWarning)\n"
                  f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n")
        return compile(source, f"<{fullname}, moved to {new}>", "exec")


def install() -> None:
    """Put the finder at the end of ``sys.meta_path`` (once): it answers only names no other finder has."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
