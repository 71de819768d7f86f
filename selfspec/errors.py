"""Errors a user can fix. The CLI prints them on one line and exits with code 2."""


class SelfspecError(Exception):
    """Base class for errors caused by input: a bad argument, a missing file, an unsupported model."""


class ModelLoadError(SelfspecError):
    """The model could not be located, converted or loaded."""


class CacheFullError(SelfspecError):
    """The paged KV cache has no free block left for a write."""
