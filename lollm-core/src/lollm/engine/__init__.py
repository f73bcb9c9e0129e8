"""The batched engine: continuous batching over a paged KV cache with prefix caching.

* :mod:`lollm.engine.blocks`    – the block pool: reference counts, free list, prefix names (LRU)
* :mod:`lollm.engine.cache`     – the pool's tensors and the :class:`PagedCache` a family's forward receives
* :mod:`lollm.engine.scheduler` – waiting/running queues, the token budget, preemption by recompute
* :mod:`lollm.engine.engine`    – :class:`Engine`: ``add_request``, ``step``, ``abort``

The seam a family implements is in :mod:`lollm.batch`; docs/batching.md is the lesson.
"""

from lollm.engine.engine import Engine, EngineConfig, EngineOutput

__all__ = ["Engine", "EngineConfig", "EngineOutput"]
