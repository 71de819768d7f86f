"""Where selfspec keeps what it converts, measures and builds: `$SELFSPEC_CACHE`, else
`$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "selfspec"
