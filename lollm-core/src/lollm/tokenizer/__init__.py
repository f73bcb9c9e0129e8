"""lollm's tokenizer: byte-level BPE (GPT-2, Qwen2, Llama 3 style), written out step by step.

Start with :func:`load_tokenizer` (reads a model folder) and the
:class:`Tokenizer` it returns. The modules follow the encoding pipeline:

* :mod:`~lollm.tokenizer.added_tokens`: cut ``<|im_start|>`` and friends out of the text;
* :mod:`~lollm.tokenizer.normalize`: Unicode normalization (NFC, ...);
* :mod:`~lollm.tokenizer.pretokenize`: split the text into words with a regex;
* :mod:`~lollm.tokenizer.byte_level`: GPT-2's bytes <-> printable characters table;
* :mod:`~lollm.tokenizer.bpe`: the merge loop that turns a word into tokens;
* :mod:`~lollm.tokenizer.stream`: decode generated ids without splitting characters;
* :mod:`~lollm.tokenizer.chat`: render chat messages with the model's Jinja template;
* :mod:`~lollm.tokenizer.loading`: read tokenizer.json, vocab.json + merges.txt, tokenizer_config.json.

See docs/tokenizer.md for the walk-through. This package never imports torch.
"""

from lollm.tokenizer.loading import load_tokenizer
from lollm.tokenizer.stream import StreamDecoder
from lollm.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer", "load_tokenizer"]
