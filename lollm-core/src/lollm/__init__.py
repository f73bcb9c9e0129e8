"""lollm: a study-first LLM inference engine.

The package is light to import (no torch at import time). Core reads as layers, each
importing only those below it (docs/architecture.md walks them from ``lollm run`` to one token):

* the contract: :mod:`lollm.hookspecs`, :mod:`lollm.family`, :mod:`lollm.model`, :mod:`lollm.errors`,
  :mod:`lollm.sampling_params`
* files: :mod:`lollm.gguf` (the GGUF reader), :mod:`lollm.tokenizer` (BPE, SentencePiece, chat templates)
* the model seams: :mod:`lollm.batch`, :mod:`lollm.attention`, :mod:`lollm.kernels`, :mod:`lollm.native`,
  and the recorder families call, :mod:`lollm.trace`
* :mod:`lollm.load` – spec ─► checkpoint ─► router ─► ``family.load`` (``open_model``)
* :mod:`lollm.generate` – one request: the shared prefill/decode loop, the sampler, grammars, drafters
* :mod:`lollm.engine` – many requests: the scheduler, paged KV, the driver; ``LLM`` (``from lollm import LLM``)
* :mod:`lollm.serve` – ``lollm serve``'s HTTP server
* :mod:`lollm.proof` – the parity gate and the benchmarks
* :mod:`lollm.cli` – the commands; :mod:`lollm.testing` – the kit for plugin authors (production never imports it)
"""

import importlib

from lollm import _moved

__version__ = "0.2.0"

#: What ``from lollm import NAME`` offers, and the module each comes from: imported on first use
#: (PEP 562), so that ``import lollm`` stays cheap (no torch) for the CLI's flag checks.
_LAZY = {
    "LLM": "lollm.engine.llm",
    "Completion": "lollm.engine.llm",
    "ImagePrompt": "lollm.engine.llm_images",
    "SamplingParams": "lollm.sampling_params",
    "EngineConfig": "lollm.engine",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lollm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


_moved.install()
