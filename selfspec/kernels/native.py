"""native.c: the fused glue ops (residual add + RMSNorm, SiLU * up, RoPE + cache write + attention) and
the float / 8-bit / 4-bit linears of the `native`, `native8` and `native4` backends (and `native8i8`,
`native4i8`: the same weights on int8 activations), compiled on first use with the
machine's C compiler and called through ctypes.

The linears run their output columns on OpenMP threads (`-fopenmp`). Loaded after torch, the library
shares torch's OpenMP runtime (the same `libgomp.so.1`), so the two never compete for cores; where the
compiler has no OpenMP, the library is built without it and the linears run on one thread.

Built once per source, compiler and CPU into the selfspec cache (`native/<key>/libselfspec.so`), so a
copied cache from another machine builds again. Where no compiler works, `library()` returns None and
`unavailable()` says why; the model then runs its eager torch ops (the reference). `SELFSPEC_NATIVE=0`
forces the reference."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from abc import abstractmethod
from functools import cache, cached_property
from pathlib import Path

import torch

from .base import Linear
from .cache import cache_root, cpu

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: the compiler fuses no multiply-add on its own, so each product and sum rounds as the
# source says (native.c's linears fuse theirs explicitly, the same way for every row).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
OPENMP = "-fopenmp"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_reason: list[str] = []


def source_key() -> str:
    """Identifies this version of native.c (measurements of its kernels are kept per version)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([source_key(), " ".join(FLAGS), version, *cpu()]).encode()).hexdigest()
    out = cache_root() / "native" / key[:16] / "libselfspec.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then moved: concurrent builds are safe
        part = Path(tmp) / out.name
        for flags in ([*FLAGS, OPENMP], FLAGS):
            command = [compiler, *flags, str(SOURCE), "-o", str(part), "-lm"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
        os.replace(part, out)
    return out


class LinearSpec(ctypes.Structure):
    """native.c's linear_spec: one linear's weights as its backend keeps them (for `layers`)."""

    _fields_ = [("kind", ctypes.c_int64), ("inn", ctypes.c_int64), ("out", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in ("w", "scale", "offset")
    ]


# native.c's LINEAR_*
KINDS = {
    "zero": 0,
    "float32": 1,
    "bfloat16": 2,
    "q8": 3,
    "q4": 4,
    "q8_i8": 5,
    "q4_i8": 6,
    "bfloat16_pairs": 7,
    "codes4": 8,
    "codes8": 9,
    "pair_codes4": 10,
    "pair_codes8": 11,
    "tile_pairs": 12,
    "tile_codes4": 13,
    "tile_codes8": 14,
    "q4_codes_i8": 15,
    "q4_pair_codes_i8": 16,
    "q2_i8": 17,
}


class LayerSpec(ctypes.Structure):
    """native.c's layer_spec: one layer's norms, linears and window (for `layers`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm")]
    _fields_ += [(name, ctypes.POINTER(LinearSpec)) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("window", ctypes.c_int64)]


class PassInfo(ctypes.Structure):
    """native.c's pass_info: what every layer of one pass reads (ops.Fused.prepare)."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("cos", "sin", "positions", "write_slots", "tables")]
        + [(name, ctypes.c_int64) for name in ("max_blocks", "block_size")]
        + [("num_tokens", ctypes.c_void_p)]
        + [(name, ctypes.c_int64) for name in ("batch", "seq_len", "heads", "kv_heads", "dim", "hidden")]
        + [("scale", ctypes.c_float), ("eps", ctypes.c_float), ("bf", ctypes.c_int64), ("threads", ctypes.c_int64)]
    )


class Native:
    """The compiled library; each method takes contiguous CPU tensors of one activation dtype."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.add_norm.argtypes = [p, p, p, p, p, i, i, f, ctypes.c_int, ctypes.c_int]
        lib.silu_mul.argtypes = [p, p, i, i, ctypes.c_int, ctypes.c_int]
        lib.linear_dense.argtypes = [p, p, p, i, i, i, ctypes.c_int, ctypes.c_int]
        lib.linear_q4.argtypes = [p, p, p, p, p, i, i, i, ctypes.c_int]
        lib.linear_q8.argtypes = [p, p, p, p, i, i, i, ctypes.c_int]
        lib.linear_codes.argtypes = [p, p, p, i, i, i, ctypes.c_int, ctypes.c_int]
        info = ctypes.POINTER(PassInfo)
        lib.attend_pass.argtypes = [info, p, p, i, i, p]
        lib.layers.argtypes = [info, p, i, p, i, p, p, p, p]  # the arrays by address: callers start mid-array
        lib.linear_act.argtypes = [ctypes.POINTER(LinearSpec), p, p, i, ctypes.c_int, ctypes.c_int]
        lib.shortlist.argtypes = [p, i, i, i, p, i, p, ctypes.c_int]
        lib.argmax_rows.argtypes = [p, i, i, p]
        fns = (lib.add_norm, lib.silu_mul, lib.attend_pass, lib.linear_dense, lib.linear_q4, lib.linear_q8, lib.layers)
        fns += (lib.linear_codes, lib.linear_act)
        lib.draft_tokens.argtypes = [info, p, i, p, i, p, p, ctypes.POINTER(LinearSpec), i, p, p, p, p, p, p, p, p]
        lib.accept_drafts.argtypes = [p, i, i, i, p, p, p, p, p, p, p, p, f, p, p]
        fns += (lib.shortlist, lib.argmax_rows, lib.draft_tokens, lib.accept_drafts)
        for fn in fns:
            fn.restype = None
        self.dot_i8 = bool(lib.dot_i8())  # the int8-activation linears are built (AVX2 and F16C)
        if self.dot_i8:
            lib.linear_q4_i8.argtypes = [p, p, p, i, i, i, ctypes.c_int]
            lib.linear_q8_i8.argtypes = lib.linear_q8.argtypes
            lib.linear_q4_i8.restype = lib.linear_q8_i8.restype = None
        self.q2 = bool(lib.q2_i8())  # linear_q2_i8 is built (AVX2, F16C and AVX-512 BW)
        if self.q2:
            lib.linear_q2_i8.argtypes = lib.linear_q4_i8.argtypes
            lib.linear_q2_i8.restype = None
        self.shared_codes = bool(lib.shared_codes())  # linear_q4_codes_i8 is built (AVX512-VBMI and AVX512BW)
        if self.shared_codes:
            lib.linear_q4_codes_i8.argtypes = [p, p, p, i, i, i, ctypes.c_int, ctypes.c_int]
            lib.linear_q4_codes_i8.restype = None
        self.greedy = bool(lib.greedy_head())  # greedy_codes8 is built (AVX512-VBMI and VNNI)
        if self.greedy:
            lib.greedy_codes8.argtypes = [p, p, p, i, i, i, ctypes.c_int, ctypes.c_int, ctypes.c_int, p]
            lib.greedy_bound.argtypes = [p, i, i, ctypes.c_int, p]
            lib.greedy_codes8.restype = lib.greedy_bound.restype = None
        self.pairs = bool(lib.bf16_pairs())  # bfloat16 weights in pair panels (AVX512-BF16)
        if self.pairs:
            lib.linear_pairs.argtypes = [p, p, p, i, i, i, ctypes.c_int]
            lib.linear_pair_codes.argtypes = lib.linear_codes.argtypes
            lib.linear_pairs.restype = lib.linear_pair_codes.restype = None
        # bfloat16 linears on AMX tiles (AMX-BF16, and the tile state granted by Linux)
        self.tiles, self.tiles_why = bool(lib.tiles()), None
        if not self.tiles:
            self.tiles_why = "no AMX-BF16 on this CPU (or the C compiler lacks it)"
        elif not lib.tiles_ready():
            self.tiles, self.tiles_why = False, "Linux did not grant AMX's tile state (arch_prctl XTILEDATA)"
        if self.tiles:
            lib.linear_tiles.argtypes = lib.linear_codes.argtypes
            lib.linear_tiles.restype = None
        self.lib, self.path = lib, path

    def add_norm(
        self, h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., n] (+ y [..., n]) -> (h + y, rms_norm(h + y) * weight): new tensors, except that
        without y the first is h itself."""
        n = h.shape[-1]
        out = torch.empty_like(h) if y is not None else h
        x = torch.empty_like(h)
        self.lib.add_norm(
            h.data_ptr(),
            None if y is None else y.data_ptr(),
            out.data_ptr(),
            weight.data_ptr(),
            x.data_ptr(),
            h.numel() // n,
            n,
            eps,
            DTYPES[h.dtype],
            torch.get_num_threads(),
        )
        return out, x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2n] -> silu(gate) * up [..., n]."""
        n = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], n)
        rows, bf = gate_up.numel() // (2 * n), DTYPES[gate_up.dtype]
        self.lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, bf, torch.get_num_threads())
        return out

    def shortlist(self, scores: torch.Tensor, k: int, x: torch.Tensor, weight: torch.Tensor) -> None:
        """scores [rows, n] float32: each row's k highest (k <= n) replaced in place by the exact x [rows, in]
        @ weight[i] (weight [n, in] float32 or bfloat16) at their indices i."""
        rows, n = scores.shape
        x = x.to(torch.float32).contiguous()
        bf = DTYPES[weight.dtype]
        self.lib.shortlist(scores.data_ptr(), rows, n, k, x.data_ptr(), x.shape[-1], weight.data_ptr(), bf)

    def accept(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        caps: torch.Tensor,
        q: list[torch.Tensor | None],
        processing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        u: torch.Tensor,
        u_final: torch.Tensor,
        eps: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """native.c's accept_drafts: logits [B, W, vocab] float32, drafts [B, W - 1], caps [B] int64, q [B *
        (W - 1)] (each a float32 [vocab] or None: a point mass), processing (temperature, top_k, top_p)
        [B] each, u [B, W - 1] and u_final [B] float32 -> accepted [B]; out [B, W] gets the tokens."""
        rows, width, vocab = logits.shape
        addresses = (ctypes.c_void_p * max(len(q), 1))(*(None if t is None else t.data_ptr() for t in q))
        accepted = torch.empty(rows, dtype=torch.int64, device=logits.device)
        self.lib.accept_drafts(
            logits.data_ptr(),
            rows,
            width,
            vocab,
            drafts.data_ptr(),
            caps.data_ptr(),
            addresses,
            *(t.data_ptr() for t in processing),
            u.data_ptr(),
            u_final.data_ptr(),
            eps,
            out.data_ptr(),
            accepted.data_ptr(),
        )
        return accepted

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] float32 on the CPU, contiguous -> [...] int64, as torch.argmax(x, -1)."""
        n = x.shape[-1]
        out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
        self.lib.argmax_rows(x.data_ptr(), x.numel() // n, n, out.data_ptr())
        return out


@cache
def library() -> Native | None:
    """The compiled library, or None (then `unavailable()` says why)."""
    if os.environ.get("SELFSPEC_NATIVE", "1") == "0":
        _reason.append("SELFSPEC_NATIVE=0")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        _reason.append("no C compiler (cc, gcc or clang) on PATH")
        return None
    try:
        return Native(_build(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _reason.append(f"building native.c failed: {str(e).splitlines()[0]}")
        return None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] -> [...] int64, torch.argmax(logits, -1) (native.c's where it runs: ~9 against
    ~55 us for 49152 float32 logits here, and a greedy draft step takes one)."""
    lib = library() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    return logits.argmax(-1) if lib is None else lib.argmax(logits.contiguous())


def unavailable() -> str | None:
    """Why the native ops are not in use (None: they are)."""
    return None if library() is not None else _reason[-1]


class NativeLinear(Linear):
    """What the native backends share: CPU only, float32 or bfloat16 activations, the compiled library,
    and an input width that is a whole number of the kernel's vector steps (`multiple`)."""

    row_exact = True  # by construction, see native.c
    multiple = 16
    kind: str  # native.c's LINEAR_* for this backend's kernel (KINDS)
    needs: str | None = None  # the Native flag saying this build holds the backend's kernel (None: every build)
    lacking = ""  # why it is unavailable where the build lacks that kernel

    def __init__(
        self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype, device
    ) -> None:
        super().__init__(out_features, in_features, bias, dtype, device)
        why = self.unavailable(dtype, device)
        if why:
            raise RuntimeError(why)
        if in_features % self.multiple:
            raise ValueError(f"{self.name}: {in_features} input features are not a multiple of {self.multiple}")
        self.native = library()
        self.lib = self.native.lib

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A decoding step's path: contiguous [..., in] in, one C call (bfloat16 widened before it and
        rounded after), [..., out] out. Each torch op costs ~2-3 us here, several times a small
        kernel's own work, and a step makes ~120 calls."""
        if residual is None and self.bias is None and x.is_contiguous():
            return self.matmul(x)
        return super().__call__(x, residual)

    @cached_property
    def spec(self) -> LinearSpec | None:
        """This linear for native.c's `layers` (None with a bias, which the separate path adds). It holds
        the weights' addresses: a backend's tensors stay as __init__ made them."""
        if self.bias is not None:
            return None
        w, scale, offset = self.tensors()
        ptr = [None if t is None else t.data_ptr() for t in (w, scale, offset)]
        return LinearSpec(KINDS[self.kind], self.in_features, self.out_features, *ptr)

    @abstractmethod
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weights or codes, scales, offsets) as the kernel reads them."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: the kernels take and give float32; bfloat16 activations are widened
        and rounded back in the same C call (`linear_act`, as `layers` runs them)."""
        if x.dtype == self.dtype == torch.bfloat16 and self.spec is not None:
            x = x.contiguous()
            y = x.new_empty((*x.shape[:-1], self.out_features))
            rows = x.numel() // self.in_features
            self.lib.linear_act(ctypes.byref(self.spec), x.data_ptr(), y.data_ptr(), rows, 1, torch.get_num_threads())
            return y
        y = self.matmul_float32(x)
        return y if self.dtype is torch.float32 else y.to(self.dtype)

    def matmul_float32(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] float32: the kernel's own output, not rounded to the activations' dtype."""
        x = x.to(torch.float32).contiguous()
        y = x.new_empty((*x.shape[:-1], self.out_features))
        self.kernel(x, y, x.numel() // self.in_features, torch.get_num_threads())
        return y

    @abstractmethod
    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        """y [rows, out] = x [rows, in] @ W.T, both float32 and contiguous, on `threads` OpenMP threads."""

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if torch.device(device).type != "cpu":
            return "native.c is CPU code"
        if dtype not in DTYPES:
            return f"{cls.name} takes float32 or bfloat16 activations, not {dtype}"
        why = unavailable()
        if why is None and cls.needs is not None and not getattr(library(), cls.needs):
            return cls.lacking
        return why
