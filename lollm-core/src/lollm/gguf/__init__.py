"""GGUF: read llama.cpp's model files and dequantize their tensors (numpy; torch only for the result).

* :class:`GGUFFile` – open a file: ``.version``, ``.metadata``, ``.tensors``,
  ``.raw(name)``, ``.dequantize(name)``.
* :class:`GGUFTensorSource` – the loader's TensorSource interface over a GGUF
  file (``fmt = "gguf"``), for streaming a model in one tensor at a time.
* :mod:`lollm.gguf.quants` – the ggml type table and one dequantizer per
  block format, each explained for a learner.

docs/gguf.md describes the file format and the block formats.
"""

from lollm.errors import GGUFError
from lollm.gguf.quants import GGML_TYPES, GGML_TYPES_BY_NAME, SUPPORTED_TYPES, GGMLType, dequantize
from lollm.gguf.reader import GGUFFile, GGUFTensorInfo, GGUFTensorSource

__all__ = [
    "GGML_TYPES",
    "GGML_TYPES_BY_NAME",
    "GGMLType",
    "GGUFError",
    "GGUFFile",
    "GGUFTensorInfo",
    "GGUFTensorSource",
    "SUPPORTED_TYPES",
    "dequantize",
]
