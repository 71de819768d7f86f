"""A description of the machine a benchmark ran on, stored beside its results."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path


def describe(threads: int) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def markdown(machine: dict) -> str:
    return (
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine['threads']} torch threads; torch {machine['torch']}, transformers {machine['transformers']}, "
        f"Python {machine['python']}; {machine['date']}."
    )


def save(out: str | Path, result: dict, lines: list[str]) -> None:
    """Writes `result` to out.json and `lines` under the machine's line (result["machine"]) to out.md."""
    out = Path(out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result["machine"]) + "\n\n" + "\n".join(lines) + "\n")
