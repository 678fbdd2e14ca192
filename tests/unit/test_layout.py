"""The package stays readable: short modules, and no production module leans on test code."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "trtdisagg"
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_module_has_at_most_500_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"


def test_production_modules_import_no_test_code() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(found)
        for path in _modules()
        if "testing" not in path.parts
        and (
            found := {
                name
                for name in _imported(path)
                if name.split(".")[0] == "tests" or "testing" in name.split(".")
            }
        )
    }
    assert offenders == {}, offenders
