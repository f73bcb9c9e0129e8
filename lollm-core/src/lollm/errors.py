"""The errors lollm raises on bad input.

Every error a user can cause (a wrong path, a broken file, a missing plugin)
is a subclass of :class:`LollmError`. The CLI prints the message of such an
error in one line and exits with status 2, without a Python traceback; any
other exception is a bug in lollm and keeps its traceback.
"""


class LollmError(Exception):
    """Base of every error lollm raises on bad input; the CLI prints its message without a traceback."""


class CheckpointError(LollmError):
    """A checkpoint folder, file or repo id is missing, incomplete or of a refused kind (pickle)."""


class GGUFError(CheckpointError):
    """A GGUF file is truncated, corrupted or uses a feature we do not read; the message names the file and the field or tensor."""


class ConfigError(LollmError):
    """config.json (or GGUF metadata) is missing a key, or has a value we do not implement."""


class WeightsError(LollmError):
    """A tensor is missing, unexpected, or has the wrong shape for the model being built."""


class TokenizerError(LollmError):
    """A tokenizer file is missing, malformed or uses a feature we do not implement."""


class PluginError(LollmError):
    """A family plugin failed to import, speaks another contract version, or registered badly."""


class UnknownModelType(PluginError):
    """No installed family serves this model type (or GGUF architecture)."""


class DuplicateModelType(PluginError):
    """Two installed families claim the same model type (or GGUF architecture)."""


class UnknownFamily(PluginError):
    """No installed family has the name given with ``--family`` (or ``family=``)."""


class GenerationError(LollmError):
    """Bad generation request: prompt longer than the context, invalid sampling values."""


class AttentionBackendError(LollmError):
    """An unknown attention backend name (``--attn``, ``LOLLM_ATTN``), or one that cannot run here."""


class ImageError(LollmError):
    """An image is refused (lollm.vision): unreadable, truncated, too large, of a refused kind, or sent to a
    model without a vision tower; the message names the image (its path, or "image 2 of the request")."""
