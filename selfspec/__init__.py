"""selfspec: self-speculative decoding on PyTorch."""

from .decoding.drafter import Draft, Drafter, ExitDrafter
from .decoding.engine import Engine
from .decoding.head import HeadDrafter
from .decoding.policy import SpecOverride
from .decoding.request import GenerationChunk, GenerationResult
from .decoding.round import SpecConfig
from .decoding.sampling import SamplingParams
from .decoding.stats import DecodeStats, SpecStats
from .errors import CacheFullError, ModelLoadError, SelfspecError

__all__ = [
    "CacheFullError",
    "DecodeStats",
    "Draft",
    "Drafter",
    "Engine",
    "ExitDrafter",
    "GenerationChunk",
    "GenerationResult",
    "HeadDrafter",
    "ModelLoadError",
    "SamplingParams",
    "SelfspecError",
    "SpecConfig",
    "SpecOverride",
    "SpecStats",
]
__version__ = "0.1.0"
