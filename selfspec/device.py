"""Which device the engine runs on. Everything the model computes with (weights, the paged KV cache,
RoPE tables, attention metadata, sampling draws) lives on the model's device; tensors are made there
with an explicit `device=`, never on an implied default.

CUDA graphs are not used for the draft or verify steps: a step is not fixed-shape. The row-exact
attention (model/attention.py) attends each query over exactly its own keys, so the kernels' shapes
change with every position; the attention metadata is rebuilt from Python lists each step; and a
draft step reads its tokens back to build the next input. A graph would need attention over a padded
block table up to a fixed context (a fused paged-attention kernel) and on-device draft feedback."""

from __future__ import annotations

import torch

from .errors import SelfspecError

DEVICES = ("cpu", "cuda")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or a torch.device -> the torch.device, checked to be usable here."""
    try:
        d = torch.device("cpu" if device is None else device)
    except RuntimeError:
        raise SelfspecError(f"device {device!r} is invalid: use one of {', '.join(DEVICES)}") from None
    if d.type not in DEVICES:
        raise SelfspecError(f"device {str(d)!r} is not supported: use one of {', '.join(DEVICES)}")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise SelfspecError(
                f"device 'cuda' requested, but torch.cuda.is_available() is False (torch {torch.__version__}"
                f"{', a CPU-only build' if torch.version.cuda is None else ', no usable GPU or driver'}): "
                "install a CUDA build of torch on a machine with an NVIDIA GPU, or use --device cpu"
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise SelfspecError(f"device {str(d)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return d


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA runs asynchronously: timings need this)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
