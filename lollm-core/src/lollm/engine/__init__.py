"""The batched engine: continuous batching over a paged KV cache with prefix caching.

* :mod:`lollm.engine.blocks`    – the block pool: reference counts, free list, prefix names (LRU)
* :mod:`lollm.engine.cache`     – the pool's tensors and the :class:`PagedCache` a family's forward receives
* :mod:`lollm.engine.scheduler` – waiting/running queues, the token budget, preemption by recompute
* :mod:`lollm.engine.engine`    – :class:`Engine`: ``add_request``, ``step``, ``abort``
* :mod:`lollm.engine.driver`    – the loop that steps an engine for its callers (the server's, ``LLM``'s)
* :mod:`lollm.engine.llm`       – ``LLM``: offline batches of prompts (``from lollm import LLM``)

The seam a family implements is in :mod:`lollm.batch`; docs/batching.md is the lesson.

``Engine``, ``EngineConfig`` and ``EngineOutput`` are looked up on first use (PEP 562), so
that ``from lollm import LLM`` imports no torch until a model is opened.
"""

from __future__ import annotations

import importlib

__all__ = ["Engine", "EngineConfig", "EngineOutput"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'lollm.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module("lollm.engine.engine"), name)
    globals()[name] = value
    return value
