"""The package's shape (issue 12): data flows one way, and nothing climbs back up.

The import graph of bfexp/ is read from the source (every import, the lazy
ones inside functions included; imports for type checkers only are not
imports at run time): it has no cycle, and nothing but the CLI imports the
CLI or the launcher.
"""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "bfexp"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST) -> list[str]:
    """Names of bfexp modules imported anywhere in a file, except under `if TYPE_CHECKING:`."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.startswith("bfexp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bfexp"):
            found.extend(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> nx.DiGraph:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for imported in runtime_imports(ast.parse(path.read_text())):
            target = resolve(imported)
            # a package importing its own submodules (its public surface) is not an edge back
            if target and target != name and not target.startswith(name + "."):
                graph.add_edge(name, target)
    return graph


def test_no_import_cycle():
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles == [], f"import cycles in bfexp/: {cycles}"


def test_nothing_imports_the_cli_or_the_launcher_but_the_cli():
    graph = import_graph()
    for top in ("bfexp.cli", "bfexp.launch"):
        # bfexp.run (`bfexp-run`) is the other entry point: it launches a user's script with launch's code.
        importers = sorted(set(graph.predecessors(top)) - {"bfexp.cli", "bfexp.run"})
        assert importers == [], f"{top} is imported by {importers}: data must flow cli -> launch -> worker"


def test_scaling_is_arithmetic_on_numbers():
    """scaling.py imports no torch, no engine and no config: the worker and probes measure, it combines."""
    source = (PACKAGE / "scaling.py").read_text()
    imported = {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] == "torch" or m.startswith(("bfexp.comm", "bfexp.config"))}
