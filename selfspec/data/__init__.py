"""Data shipped with the package (see README.md beside this file for sources and licences)."""

from pathlib import Path

DEV_SET = Path(__file__).resolve().parent / "spec_bench_dev.jsonl"  # Spec-Bench dev half, Apache-2.0
