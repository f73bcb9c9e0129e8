"""lollm's tokenizer: byte-level BPE (GPT-2, Qwen2, Llama 3) and SentencePiece BPE (Llama 2, Gemma), step by step.

Start with :func:`load_tokenizer` (reads a model folder) or
:func:`load_gguf_tokenizer` (reads GGUF metadata) and the :class:`Tokenizer`
they return. The modules follow the encoding pipeline:

* :mod:`~lollm.tokenizer.added_tokens`: cut ``<|im_start|>`` and friends out of the text;
* :mod:`~lollm.tokenizer.normalize`: Unicode normalization (NFC, ...);
* :mod:`~lollm.tokenizer.pretokenize`: split the text into words with a regex;
* :mod:`~lollm.tokenizer.byte_level`: GPT-2's bytes <-> printable characters table;
* :mod:`~lollm.tokenizer.bpe`: the merge loop that turns a word into tokens;
* :mod:`~lollm.tokenizer.sentencepiece`: tokenizer.model files, SentencePiece's normalizer and BPE by score;
* :mod:`~lollm.tokenizer.decoders`: what bytes each token stands for (byte-level, or "▁" and ``<0xNN>``);
* :mod:`~lollm.tokenizer.stream`: decode generated ids without splitting characters;
* :mod:`~lollm.tokenizer.chat`: render chat messages with the model's Jinja template;
* :mod:`~lollm.tokenizer.loading`: read tokenizer.json, tokenizer.model, vocab.json + merges.txt, tokenizer_config.json;
* :mod:`~lollm.tokenizer.from_gguf`: build a tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

See docs/tokenizer.md for the walk-through. This package never imports torch.
"""

from lollm.tokenizer.from_gguf import load_gguf_tokenizer
from lollm.tokenizer.loading import load_tokenizer
from lollm.tokenizer.stream import StreamDecoder
from lollm.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer", "load_gguf_tokenizer", "load_tokenizer"]
