"""Where selfspec keeps what it converts, measures and builds: `$SELFSPEC_CACHE`, else
`$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`; and the CPU those entries are valid for."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "selfspec"


def cpu() -> tuple[str, str]:
    """(the CPU model, its ISA flags) from /proc/cpuinfo; the architecture and "" where it is unreadable."""
    model, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and model == platform.machine():
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    return model, flags
