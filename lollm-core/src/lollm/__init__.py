"""lollm: a study-first LLM inference engine.

The package is light to import (no torch at import time). The main pieces:

* :mod:`lollm.loader`   – spec ─► Checkpoint (configs, weights by file names, tokenizer files)
* :mod:`lollm.plugins`  – installed family plugins and the router
* :mod:`lollm.pipeline` – ``open_model(spec)``: loader ─► router ─► family.load
* :mod:`lollm.generate` – the shared prefill/decode loop; :mod:`lollm.sampling` – the sampler
* :mod:`lollm.tokenizer`– byte-level BPE and chat templates
* :mod:`lollm.parity`, :mod:`lollm.bench` – proving and measuring against transformers
* :mod:`lollm.hookspecs`, :mod:`lollm.family` – the plugin contract
* :mod:`lollm.llm`     – ``LLM``: offline batches of prompts through the engine (``from lollm import LLM, SamplingParams``)
"""

__version__ = "0.2.0"

#: What ``from lollm import NAME`` offers, and the module each comes from: imported on first use
#: (PEP 562), so that ``import lollm`` stays cheap (no torch) for the CLI's flag checks.
_LAZY = {
    "LLM": "lollm.llm",
    "Completion": "lollm.llm",
    "SamplingParams": "lollm.sampling_params",
    "EngineConfig": "lollm.engine",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lollm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
