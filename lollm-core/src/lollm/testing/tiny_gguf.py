"""Tiny GGUF files for tests, written with gguf-py's ``GGUFWriter`` (llama.cpp's own writer library).

Families without a real GGUF here are tested on small random checkpoints:
transformers writes the safetensors (:mod:`lollm.testing.tiny`), the family's
test names the tensors the way llama.cpp's converter does, and
:func:`write_gguf` stores them, each in the ggml type asked for (``F32``,
``F16``, ``Q8_0`` … quantized by ``gguf.quants.quantize``), with the metadata
given. :func:`byte_level_vocab` trains a small byte-level BPE so the file can
carry a working ``gpt2`` tokenizer.

``gguf`` and ``tokenizers`` are test tooling (``lollm-core[parity]``): imported
inside the functions only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

# Lazy imports below: tokenizers (lollm-core[test]) and gguf (lollm-core[parity]), optional extras.

#: Text the tiny tokenizers are trained on (English and a little Python).
CORPUS = [
    "The history of the Roman Empire begins with the founding of the city of Rome, which legend dates to 753 BC.",
    "Over the following centuries the small settlement on the Tiber grew into a republic, and then into an empire.",
    "It stretched from Britain to Egypt. Write a short summary of how it rose and why it fell.",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n    return quicksort([x for x in items[1:] if x < pivot]) + [pivot]",
    "Large language models predict the next token from the tokens before it; attention lets every position look back.",
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ? ' \" # @ $ % ^ & | ~ `",
] * 4


def byte_level_vocab(vocab_size: int, specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """(tokens, merges, token_types) of a byte-level BPE with exactly ``vocab_size`` tokens.

    The special tokens come first (ids 0, 1, …; type 3 = control), then the 256
    byte symbols, then merges learned from :data:`CORPUS`; if the corpus runs out
    of merges, ``<|reserved_N|>`` tokens (type 4, user-defined) fill the rest.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens: list[str] = [""] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    if len(tokens) > vocab_size:
        raise ValueError(f"the trainer made {len(tokens)} tokens, more than {vocab_size}")
    while len(tokens) < vocab_size:
        tokens.append(f"<|reserved_{len(tokens)}|>")
        types.append(4)
    return tokens, merges, types


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: Mapping[str, bool | int | float | str | list],
    tensors: Mapping[str, tuple[np.ndarray, str]],
) -> Path:
    """Write a GGUF file: ``general.architecture = arch``, the metadata, then the tensors in order.

    metadata values: bool -> bool, int -> uint32, float -> float32, str -> string,
    list -> array (element type from the first element: str -> string, int -> int32).
    tensors: name -> (float32 numpy array in PyTorch shape order, ggml type name);
    ``F32`` and ``F16`` are stored as such, any other type is quantized with
    ``gguf.quants.quantize`` (the last dimension must be a multiple of its block size).
    """
    import gguf
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            raise TypeError(f"{key}: cannot write a {type(value).__name__}")
    for name, (array, type_name) in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        qtype = gguf.GGMLQuantizationType[type_name]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
