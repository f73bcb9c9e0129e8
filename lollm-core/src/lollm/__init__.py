"""lollm: a study-first LLM inference engine.

The package is light to import (no torch at import time). The main pieces:

* :mod:`lollm.loader`   – spec ─► Checkpoint (configs, weights by file names, tokenizer files)
* :mod:`lollm.plugins`  – installed family plugins and the router
* :mod:`lollm.pipeline` – ``open_model(spec)``: loader ─► router ─► family.load
* :mod:`lollm.generate` – the shared prefill/decode loop; :mod:`lollm.sampling` – the sampler
* :mod:`lollm.tokenizer`– byte-level BPE and chat templates
* :mod:`lollm.parity`, :mod:`lollm.bench` – proving and measuring against transformers
* :mod:`lollm.hookspecs`, :mod:`lollm.family` – the plugin contract
"""

__version__ = "0.2.0"
