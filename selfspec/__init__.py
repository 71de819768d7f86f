"""selfspec: self-speculative decoding on PyTorch."""

from .engine import DecodeStats, Engine, GenerationChunk, GenerationResult, SpecStats
from .errors import CacheFullError, ModelLoadError, SelfspecError
from .sampling import SamplingParams
from .speculative import SpecConfig

__all__ = [
    "CacheFullError",
    "DecodeStats",
    "Engine",
    "GenerationChunk",
    "GenerationResult",
    "ModelLoadError",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "SelfspecError",
]
__version__ = "0.1.0"
