"""Linear kernels: every weight of the model is one `Linear` object made at load time, called with
activations [..., in]. A backend is one file; `BACKENDS` lists them by name. Backends the machine or
the torch build lacks say why (`Linear.unavailable`), and the loader falls back to `dense`."""

from .base import Linear
from .dense import Dense
from .int4 import Int4
from .int8 import Int8
from .native_codes import NativeCodes
from .native_dot import NativeInt4Dot, NativeInt8Dot
from .native_float import NativeFloat
from .native_int4 import NativeInt4
from .native_int8 import NativeInt8
from .native_tiles import NativeTiles
from .onednn import OneDNN

BACKENDS: dict[str, type[Linear]] = {
    b.name: b
    for b in (
        Dense,
        OneDNN,
        NativeTiles,
        NativeCodes,
        NativeFloat,
        Int8,
        NativeInt8,
        NativeInt8Dot,
        Int4,
        NativeInt4,
        NativeInt4Dot,
    )
}

__all__ = [
    "BACKENDS",
    "Dense",
    "Int4",
    "Int8",
    "Linear",
    "NativeCodes",
    "NativeFloat",
    "NativeInt4",
    "NativeInt4Dot",
    "NativeInt8",
    "NativeInt8Dot",
    "NativeTiles",
    "OneDNN",
]
