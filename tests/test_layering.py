"""The layering as a test: every pagemill module imports only from its own layer or below, and no module imports
form a cycle (DESIGN.md §2; docs/design/architecture.md explains the table).

Every import counts: at module level, under `if TYPE_CHECKING:` and inside functions. A platform names the classes
above it (worker, attention backends, communicator) by import path strings, which are not imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "pagemill"

# Lowest first. A module belongs to the layer of the longest prefix listed here that names it (a package's entry
# covers its modules unless a module is listed on its own).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("utils", ("pagemill.utils",)),
    # What users hand in and get back: engine configuration and per-request parameters and results.
    ("config", ("pagemill.config", "pagemill.sampling_params", "pagemill.pooling_params", "pagemill.pooling.config",
                "pagemill.lora.request", "pagemill.outputs", "pagemill.beam_search")),
    ("platforms", ("pagemill.platforms",)),
    # Scheduling, sampling and the layers models are built from, with what they share: the engine core's messages
    # and requests, the scheduler's stats, the per-step forward context, the compiled ops, the collectives, the
    # structured-output grammars and the attention-backend contract (which layers hold; backends sit above).
    ("core / sample / layers", ("pagemill.core", "pagemill.sample", "pagemill.layers", "pagemill.kernels",
                                "pagemill.request", "pagemill.messages", "pagemill.metrics.stats",
                                "pagemill.forward_context", "pagemill.distributed", "pagemill.structured_output",
                                "pagemill.reasoning", "pagemill.attention.backend", "pagemill.attention.metadata")),
    # Built from layers: models, attention backends, loaders, LoRA wrappers, draft proposers, KV connectors, and the
    # grammar manager (it loads the tokenizer).
    ("models / attention / loader", ("pagemill.models", "pagemill.attention", "pagemill.loader", "pagemill.lora",
                                     "pagemill.multimodal",
                                     "pagemill.spec_decode", "pagemill.distributed.kv_transfer",
                                     "pagemill.structured_output.manager")),
    ("worker", ("pagemill.worker",)),
    ("engine", ("pagemill.engine", "pagemill.metrics", "pagemill.pooling")),
    ("entrypoints / benchmarks", ("pagemill", "pagemill.entrypoints", "pagemill.benchmarks", "pagemill.llm",
                                  "pagemill.env")),
]

# (importer, imported) pairs allowed to break the rules, with the reason. At most 3.
EXCEPTIONS: dict[tuple[str, str], str] = {}
MAX_EXCEPTIONS = 3


def module_name(path: Path) -> str:
    """pagemill/core/scheduler.py -> pagemill.core.scheduler; a package's __init__.py is the package."""
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    """Every module of the pagemill package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The pagemill module `name` refers to (an attribute of a module names the module), else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported pagemill module, line) for every import statement anywhere in the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            if candidate == "pagemill" or candidate.startswith("pagemill."):
                target = _target(candidate, modules)
                if target is not None and target != name:
                    yield target, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}."""
    modules = all_modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(name, path, modules):
            edges.setdefault(target, line)
    return graph


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module`."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise KeyError(module)
    return best


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_every_module_has_a_layer() -> None:
    """A new top-level package or module must be placed in LAYERS."""
    unplaced = []
    for name in all_modules():
        try:
            layer_of(name)
        except KeyError:
            unplaced.append(name)
    assert not unplaced, f"add these modules to LAYERS in tests/test_layering.py: {unplaced}"


def test_no_upward_imports() -> None:
    """No module imports from a layer above its own (except the listed EXCEPTIONS)."""
    modules = all_modules()
    upward = []
    for name, edges in import_graph().items():
        for target, line in edges.items():
            if layer_of(target) > layer_of(name) and (name, target) not in EXCEPTIONS:
                rel = modules[name].relative_to(PACKAGE_ROOT.parent)
                upward.append(f"{rel}:{line}: {name} ({LAYERS[layer_of(name)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports point up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    """No set of modules imports each other in a circle (the listed EXCEPTIONS' edges left out)."""
    graph = {name: {t: line for t, line in edges.items() if (name, t) not in EXCEPTIONS}
             for name, edges in import_graph().items()}
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_exceptions_are_few_and_still_needed() -> None:
    """At most MAX_EXCEPTIONS exceptions, each with a reason and each an import that still exists."""
    assert len(EXCEPTIONS) <= MAX_EXCEPTIONS
    graph = import_graph()
    for (importer, imported), reason in EXCEPTIONS.items():
        assert reason.strip(), (importer, imported)
        assert imported in graph.get(importer, {}), f"stale exception: {importer} no longer imports {imported}"


def test_cycle_finder_finds_a_cycle() -> None:
    """The cycle check itself works: a -> b -> c -> a is one component, d alone none."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
