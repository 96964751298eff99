"""The architecture the file tree promises: the library never imports its tools room, and the layer
holds no backend- or format-specific code (that lives in the runners)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `python -m moe_triton` (moe_triton/__main__.py) is the command line's door, not library code.
LIBRARY = [path for folder in ("moe_triton", "models", "graphs") for path in (ROOT / folder).rglob("*.py")
           if "tools" not in path.relative_to(ROOT).parts and path.name != "__main__.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, absolute or relative (resolved against the package it sits in)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    package = package.replace("models", "moe_triton.models", 1) if package.startswith("models") else package
    package = package.replace("graphs", "moe_triton.graphs", 1) if package.startswith("graphs") else package
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_tools_room(path):
    tools = sorted(name for name in imported_modules(path) if name.startswith("moe_triton.tools"))
    assert not tools, f"{path.relative_to(ROOT)} imports {tools}: tools sit on top of the library, not inside it"


def test_the_import_check_sees_relative_imports():
    assert "moe_triton.tools.bench" in imported_modules(ROOT / "moe_triton" / "tools" / "cli.py")
    assert "moe_triton.backends.runners.build_runner" in imported_modules(ROOT / "moe_triton" / "layer.py")


def test_the_layer_has_no_backend_or_format_branch():
    source = (ROOT / "moe_triton" / "layer.py").read_text()
    for word in ("ExpertBackend", "flashinfer", "FLASHINFER", "TORCH", "TRITON", "fp8", "FP8", "WeightFormat."):
        assert word not in source, f"layer.py names {word}: backend and format specifics belong in a runner"
