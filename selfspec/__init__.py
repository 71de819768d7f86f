"""selfspec: self-speculative decoding on PyTorch."""

from .engine import DecodeStats, Engine, GenerationChunk, GenerationResult
from .errors import CacheFullError, ModelLoadError, SelfspecError
from .sampling import SamplingParams

__all__ = [
    "CacheFullError",
    "DecodeStats",
    "Engine",
    "GenerationChunk",
    "GenerationResult",
    "ModelLoadError",
    "SamplingParams",
    "SelfspecError",
]
__version__ = "0.1.0"
