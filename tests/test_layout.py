"""The architecture the file tree promises: the library never imports its tools room, and the layer
holds no backend- or format-specific code (that lives in the runners)."""
import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `python -m moe_triton` (moe_triton/__main__.py) is the command line's door, not library code.
LIBRARY = [path for folder in ("moe_triton", "models", "graphs")
           for path in (ROOT / folder).rglob("*.py")
           if "tools" not in path.relative_to(ROOT).parts and path.name != "__main__.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, absolute or relative (resolved against the package it sits
    in)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    package = (package.replace("models", "moe_triton.models", 1) if package.startswith("models")
               else package)
    package = (package.replace("graphs", "moe_triton.graphs", 1) if package.startswith("graphs")
               else package)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (package.split(".")[: len(package.split(".")) - node.level + 1] if node.level
                    else [])
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_tools_room(path):
    tools = sorted(name for name in imported_modules(path) if name.startswith("moe_triton.tools"))
    assert not tools, (f"{path.relative_to(ROOT)} imports {tools}: "
                       "tools sit on top of the library, not inside it")


def test_the_import_check_sees_relative_imports():
    assert "moe_triton.tools.bench" in imported_modules(ROOT / "moe_triton" / "tools" / "cli.py")
    assert ("moe_triton.runners.resolver.build_runner"
            in imported_modules(ROOT / "moe_triton" / "layer.py"))


def test_the_layer_has_no_backend_or_format_branch():
    source = (ROOT / "moe_triton" / "layer.py").read_text()
    for word in ("ExpertBackend", "flashinfer", "FLASHINFER", "TORCH", "TRITON", "fp8", "FP8",
                 "WeightFormat."):
        assert word not in source, (f"layer.py names {word}: "
                                    "backend and format specifics belong in a runner")


# ---- one direction through the house ------------------------------------------------------------

# Bottom to top. A module imports only from its own layer or below (imports inside functions and
# under TYPE_CHECKING count too); within a layer the imports form no cycle. The package's
# __init__ (the public names) and __main__ sit above every layer.
LAYERS = [
    ("foundation", ["moe_triton.platform", "moe_triton.launch", "moe_triton.graphs"]),
    ("specs",
     ["moe_triton.weights", "moe_triton.checks", "moe_triton.quant_config", "moe_triton.context",
      "moe_triton.invariance"]),
    ("stages",
     ["moe_triton.activation", "moe_triton.routing", "moe_triton.expand",
      "moe_triton._expand_kernels", "moe_triton.config", "moe_triton.quantize",
      "moe_triton._expert_gemm_kernels",
      "moe_triton.expert_gemm", "moe_triton.decode", "moe_triton.finalize",
      "moe_triton.reference", "moe_triton.linear", "moe_triton.gemv"]),
    ("pipeline", ["moe_triton.pipeline"]),
    ("parallel", ["moe_triton.parallel"]),
    ("placement", ["moe_triton.placement"]),
    ("runners", ["moe_triton.runners"]),
    ("layer", ["moe_triton.layer"]),
    ("integrations", ["moe_triton.integrations"]),
    ("models", ["moe_triton.models"]),
    ("tools", ["moe_triton.tools"]),
]
TOP = ("moe_triton", "moe_triton.__main__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("models", "graphs"):
        parts.insert(0, "moe_triton")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(path): path for folder in ("moe_triton", "models", "graphs")
           for path in (ROOT / folder).rglob("*.py")}


def layer_of(module: str) -> int | None:
    """The index of `module`'s layer (None: the package's top, or not ours)."""
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    return None


def imported_sources(path: Path, package: str) -> set[str]:
    """Our modules `path` imports: `from . import checks` is moe_triton.checks, not the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (package.split(".")[: len(package.split(".")) - node.level + 1] if node.level
                    else [])
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in SOURCES else module
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in SOURCES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_edges() -> dict[str, set[str]]:
    """Our module -> the modules of ours it imports (names resolved to the module that defines
    them)."""
    edges = {}
    for module, path in SOURCES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges[module] = imported_sources(path, package) - {module}
    return edges


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in SOURCES if m not in TOP and layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


def test_imports_flow_down_the_layers():
    upward = [f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} "
              f"({LAYERS[layer_of(target)][0]})"
              for source, targets in import_edges().items() if source not in TOP
              for target in targets if target not in TOP and layer_of(target) > layer_of(source)]
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))
    into_top = sorted(f"{s} imports {t}"
                      for s, ts in import_edges().items() if s not in TOP for t in ts if t in TOP)
    assert not into_top, f"library modules import the package's public face: {into_top}"


def test_the_imports_hold_no_cycle():
    edges, state, cycles = import_edges(), {}, []

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# ---- one family, one file ----------------------------------------------------------------------

FAMILY_FILES = {name: ROOT / "models" / f"{name}.py"
                for name in ("qwen3_moe", "cohere2_moe", "minimax_m2", "minimax_m3", "nemotron_h",
                             "gpt_oss")}


def routing_specs_built(path: Path) -> list[str]:
    """The function around each `RoutingSpec(...)` call in `path` ("" at module level)."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef) else function
            if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "RoutingSpec":
                found.append(function)
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_a_familys_routing_rule_is_written_once_in_its_spec():
    """In its <family>_moe_spec(config), which load_model and from_transformers both call."""
    for name, path in FAMILY_FILES.items():
        assert routing_specs_built(path) == [f"{name.removesuffix('_moe')}_moe_spec"], path.name
    others = [p for p in LIBRARY
              if p.parent.name in ("models", "integrations") and p not in FAMILY_FILES.values()]
    built = sorted(str(p.relative_to(ROOT)) for p in others if routing_specs_built(p))
    assert not built, f"{built} build a RoutingSpec outside a family's spec"


def test_families_leave_fusedmoes_renames_and_format_to_it():
    """FusedMoE.checkpoint_renames and its weight_format=None default are the one place of both."""
    for path in FAMILY_FILES.values():
        text = path.read_text()
        assert "gate_weight" not in text and "weight_format" not in text, path.name


def test_the_package_shadows_none_of_its_modules():
    import pkgutil

    import moe_triton

    shadowed = [info.name for info in pkgutil.iter_modules(moe_triton.__path__)
                if hasattr(moe_triton, info.name)
                and not inspect.ismodule(getattr(moe_triton, info.name))]
    assert not shadowed, (f"moe_triton.<name> is not the module of that name for {shadowed}: "
                          "import it from its module")
