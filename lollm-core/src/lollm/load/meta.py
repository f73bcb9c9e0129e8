"""Build a module tree on the meta device: shapes, no memory, no random fills.

:class:`on_meta` is the first step of :func:`lollm.load.build.build_model` and of a
tensor-parallel rank's build (:mod:`lollm.load.tensor_parallel`); it lives here, below both.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class _SkipInit(TorchFunctionMode):
    """Turns every ``torch.nn.init`` function (``normal_``, ``kaiming_uniform_``, ...) into a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **(kwargs or {}))


class on_meta:
    """``with on_meta(): model = cls(config)``: build modules on the meta device, skipping ``nn.init``.

    ``nn.Linear`` and ``nn.Embedding`` fill their new parameters with random values in
    their constructors. On the meta device there are no values, but torch still runs
    the fill through its Python reference ops, and those import ``torch._dynamo`` (with
    Triton beside it when installed): about 150 MB of resident memory and a second or
    two, for numbers the checkpoint overwrites anyway. So the fills are skipped; every
    parameter is then loaded from the checkpoint (:func:`lollm.load.weights.load_weights`
    refuses a model tensor the file does not fill).
    """

    def __enter__(self):
        self._device, self._skip = torch.device("meta"), _SkipInit()
        self._device.__enter__()
        self._skip.__enter__()  # entered last, so it sees each call first
        return self

    def __exit__(self, *exc):
        self._skip.__exit__(*exc)
        return self._device.__exit__(*exc)
