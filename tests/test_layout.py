"""The package's import rules (README, "How it is built"): each subpackage imports only from those
below it, so a change to serving or calibration never reaches the model or the decoding loop."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "selfspec"
# What each subpackage may import from selfspec (besides itself); cli may import anything.
# `errors` and `device` are leaf modules (they import nothing of selfspec but errors).
ALLOWED = {
    "kernels": {"errors"},
    "model": {"errors", "device", "kernels"},
    "decoding": {"errors", "device", "kernels", "model"},
    "serving": {"errors", "device", "kernels", "model", "decoding"},
    "calibration": {"errors", "device", "kernels", "model", "decoding", "data"},
}


def imported_subpackages(source: str, package: tuple[str, ...]) -> set[str]:
    """Top-level selfspec subpackages (or modules) that a module of `package` (e.g. ("selfspec",
    "decoding")) imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                target = base + (node.module.split(".") if node.module else [])
                names = [target] if node.module else [target + [a.name] for a in node.names]
            else:
                names = [node.module.split(".")] if node.module else []
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for parts in names:
            if parts[0] == "selfspec" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_down_the_layers(package):
    bad = {}
    for path in sorted((ROOT / package).glob("*.py")):
        extra = imported_subpackages(path.read_text(), ("selfspec", package)) - ALLOWED[package] - {package}
        if extra:
            bad[path.name] = sorted(extra)
    assert not bad, f"selfspec/{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_the_rule_checker_sees_every_form_of_import():
    """The checker itself: relative, absolute and package imports reaching up are all caught."""
    source = "from ..serving.scheduler import Scheduler\nfrom . import sampling\nimport selfspec.calibration.plots\n"
    assert imported_subpackages(source, ("selfspec", "decoding")) == {"serving", "decoding", "calibration"}
    assert imported_subpackages("from .. import errors\n", ("selfspec", "model")) == {"errors"}
