"""Where selfspec keeps what it converts, measures and builds: `$SELFSPEC_CACHE`, else
`$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`; and the CPU those entries are valid for."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# The /proc/cpuinfo flags that name instruction sets (x86's flags, Arm's Features), the ones kernels and
# their costs depend on. Two VMs of one CPU model were seen to differ in the rest (mitigation and
# virtualisation flags such as md_clear or arch_capabilities), which left a profile measured on one
# untrusted on the other for no difference in what it measured. Per architecture, since a name can mean
# two things: Arm's `sme` (matrix extension) is AMD's memory encryption on x86, and Arm's `fp` prefix
# caught x86's `fpu`.
X86_ISA = re.compile(r"^(sse|ssse|avx|amx|fma|f16c|bmi|abm|adx|popcnt|movbe|aes|vaes|pclmul|vpclmul|gfni|sha_ni|xop)")
ARM_ISA = re.compile(r"^(fp|asimd|sve|sme|i8mm|bf16|dotprod|aes|pmull|sha|crc32|atomics)")
# What `isa` matched until x86 and Arm were told apart (it took x86's fpu, smep and sme too): profiles
# measured then record its hash as `isa`, and are compared by it (legacy_isa).
LEGACY_ISA = re.compile(
    r"^(sse|ssse|avx|amx|fma|f16c|bmi|abm|adx|popcnt|movbe|aes|vaes|pclmul|vpclmul|gfni|sha|xop|asimd|fp|sve|sme|i8mm|bf16|dotprod)"
)


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


def isa(flags: str, arch: str | None = None) -> str:
    """The instruction-set names among `flags` (a cpuinfo flags line) of architecture `arch` (default:
    this machine's), sorted."""
    arch = (arch or platform.machine()).lower()
    pattern = ARM_ISA if arch in ("aarch64", "arm64") or arch.startswith("arm") else X86_ISA
    return " ".join(sorted(f for f in flags.split() if pattern.match(f)))


def legacy_isa(flags: str) -> str:
    """What `isa` returned before x86 and Arm were told apart (see LEGACY_ISA)."""
    return " ".join(sorted(f for f in flags.split() if LEGACY_ISA.match(f)))
