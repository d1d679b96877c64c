"""The package's shape (issues 12, 47): data flows one way, and nothing climbs back up.

The import graph of bfexp/ (with hydra_plugins/, the Slurm plugin's shim, and
conf/, shipped as bfexp.conf) is read from the source: every import, the lazy
ones inside functions, those for type checkers only (``if TYPE_CHECKING:``) and a
package's imports of its own submodules included. It has no cycle; the lower
layers (engines, topologies, algorithms, models, data) import nothing of the job
level (config, the CLI, launch, the launchers); nothing but the CLI imports the
CLI or the launcher.
"""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bfexp"
# Top-level names whose modules are this project's (the Slurm plugin's shim lives in hydra_plugins/).
TOPS = ("bfexp", "hydra_plugins")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files() -> dict[str, Path]:
    """Every module of bfexp/ and hydra_plugins/, and conf/ (shipped as bfexp.conf), by its name."""
    files = {module_name(p): p for top in TOPS for p in (ROOT / top).rglob("*.py")}
    files["bfexp.conf"] = ROOT / "conf" / "__init__.py"
    return files


def imports(tree: ast.AST, module: str, package: bool) -> list[str]:
    """What a file imports of this project, anywhere in it (``from a import b`` as ``a.b``: b may be a
    module); relative imports resolved against ``module`` (a package's ``__init__`` when ``package``)."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if package else module.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.extend(f"{base}.{a.name}" for a in node.names)
    return [name for name in found if name.split(".")[0] in TOPS]


def import_graph() -> nx.DiGraph:
    """Module -> each module it imports (the longest known module of each imported name)."""
    files = module_files()

    def resolve(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        for imported in imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            target = resolve(imported)
            if target and target != name:
                graph.add_edge(name, target)
    return graph


def test_the_graph_sees_every_kind_of_import():
    """The edges that hid circles before issue 47 are edges: a package's import of its submodule, an import
    for type checkers only, a lazy one, the shim's import of bfexp."""
    graph = import_graph()
    for edge in [("bfexp.topology", "bfexp.topology.base"), ("bfexp.comm.engine", "bfexp.timeline"),
                 ("bfexp", "bfexp.api"), ("hydra_plugins.bfexp_slurm_launcher.launcher", "bfexp.launchers.slurm_sweep")]:
        assert graph.has_edge(*edge), edge


def test_no_import_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert cycles == [], f"import cycles (strongly connected modules): {cycles}"


# The layers below the job: engines, topologies, algorithms (compressors with them), models, data sets. They are
# built from config nodes (bfexp.components), never from the job's config rules, the CLI or a launcher.
LOWER = ("bfexp.comm", "bfexp.topology", "bfexp.algorithms", "bfexp.compression", "bfexp.models", "bfexp.data")
JOB_LEVEL = ("bfexp.config", "bfexp.cli", "bfexp.launch", "bfexp.launchers", "hydra_plugins")


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_lower_layers_import_nothing_of_the_job_level():
    """Not directly, nor through another module: a lower layer that needs a component built imports
    bfexp.components; the job's rules (bfexp.config), the CLI, launch and the launchers sit above it."""
    graph = import_graph()
    found = []
    for module in sorted(m for m in graph if within(m, LOWER)):
        above = sorted(m for m in nx.descendants(graph, module) if within(m, JOB_LEVEL))
        if above:
            found.append(" -> ".join(nx.shortest_path(graph, module, above[0])))
    assert found == [], f"lower layers reaching the job level: {found}"


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


DRIVER_MODULES = ("bfexp.cli", "bfexp.launch", "bfexp.launchers", "bfexp.launchers.local", "bfexp.launchers.mpirun",
                  "bfexp.launchers.srun", "bfexp.signals", "bfexp.sessions", "bfexp.preflight", "bfexp.summary",
                  "bfexp.run")


def test_the_driver_imports_neither_torch_nor_the_worker():
    """`bfexp --help`, `--cfg job` and bad input stay instant: the driver's modules pull in neither torch
    nor what every rank runs (checked in a fresh interpreter, as a user's shell starts one)."""
    import subprocess
    import sys

    code = ("import sys\n" + "".join(f"import {m}\n" for m in DRIVER_MODULES) +
            "print(sorted(m for m in sys.modules if m == 'torch' or m == 'bfexp.worker'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _sources() -> dict[str, ast.AST]:
    return {module_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}


def test_launchers_are_dispatched_by_their_classes_not_by_name():
    """No `if launcher.name == "srun"` outside bfexp/launchers/: a back end is one class there (and a user's
    own is one class of theirs), so nothing else may test for a launcher's name."""
    names = {"local", "mpirun", "srun"}
    found = []
    for module, tree in _sources().items():
        if module.startswith("bfexp.launchers"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Constant) and s.value in names for s in sides) and \
                        any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides):
                    found.append(f"{module}:{node.lineno}")
    assert found == [], f"launcher dispatch by name outside bfexp/launchers/: {found}"


def test_nothing_imports_a_private_name_of_another_module():
    """A name starting with `_` is its module's own: no other bfexp module imports it or reaches for it
    through the module (`launch._terminate`)."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    sources = _sources()
    for module, tree in sources.items():
        aliases: dict[str, str] = {}  # local name -> the bfexp module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bfexp"):
                for a in node.names:
                    if private(a.name) and node.module != module:
                        found.append(f"{module}:{node.lineno} imports {node.module}.{a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("bfexp"):
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name) and \
                    aliases.get(node.value.id, module) != module and aliases[node.value.id] in sources:
                found.append(f"{module}:{node.lineno} reaches {aliases[node.value.id]}.{node.attr}")
    assert found == [], f"private names used across modules: {found}"


def test_statuses_are_said_in_one_place():
    """A job's status words (completed, failed, ...) are constants of bfexp.results; no other module spells
    one out (a typo there would be a status nobody checks for)."""
    from bfexp import results

    words = set(results.STATUSES) | {results.SKIPPED, results.NOT_RUN}
    found = []
    for module, tree in _sources().items():
        if module == "bfexp.results":
            continue
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in words and id(node) not in docstrings:
                found.append(f"{module}:{node.lineno} {node.value!r}")
    assert found == [], f"status words spelt outside bfexp.results: {found}"


def test_launch_is_supervision_only_and_no_function_is_long():
    """launch.py keeps supervision (one watch loop) under 400 lines; no function or method in bfexp/ runs
    over 80 lines (a long one is several jobs: name them)."""
    assert len((PACKAGE / "launch.py").read_text().splitlines()) < 400
    long = []
    for module, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], f"functions over 80 lines: {long}"


def test_one_watch_loop_serves_the_runner_and_bfexp_run():
    """MPI ranks, virtual ranks and `bfexp-run` are watched by launch.watch; nothing else polls ranks in a loop."""
    sources = _sources()
    callers = sorted(module for module, tree in sources.items() for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "watch")
    assert callers == ["bfexp.launch", "bfexp.launch", "bfexp.run"], callers


def torch_private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every use of a torch private name in a module: an import of one (``import
    torch._dynamo``, ``from torch.optim.optimizer import _x``); a name starting with ``_`` reached through a
    torch module or anything imported from one (``torch._C``, ``torch.optim.optimizer._global_...``,
    ``getattr(torch, "_dynamo")``, ``torch.__dict__.get("_dynamo")``); a module path spelt as a string
    (``"torch._dynamo"``); and torch.optim.Optimizer's private attributes on any object (bfexp's rules are
    Optimizers), as attributes or strings (``self._optimizer_step_pre_hooks``, ``setattr(self, "_optimizer_...")``)."""
    import torch

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    optimizer_names = {n for n in (*dir(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)),
                                   *vars(torch.optim.Optimizer)) if private(n)}
    torchy: set[str] = set()  # local names bound to torch or to something imported from it
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torchy.add(a.asname or "torch")
                    if any(private(part) for part in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                torchy.add(a.asname or a.name)
                if any(private(part) for part in [*node.module.split("."), a.name]):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in torchy and any(private(a) for a in chain):
                found.append((node.lineno, ".".join([root.id, *reversed(chain)])))
            elif node.attr in optimizer_names:
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call):  # getattr(torch..., "_x"), torch.__dict__.get("_x")
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            reflective = getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr", "delattr")
            root = node.args[0] if reflective and node.args else node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torchy and any(private(n) for n in names):
                found.append((node.lineno, f"{ast.unparse(node.func)}({', '.join(map(repr, names))})"))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, str) and private(node.slice.value):  # torch.__dict__["_x"]
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torchy:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings and (
                node.value in optimizer_names or any(private(p) for p in node.value.split(".")[1:2])
                and node.value.split(".")[0] == "torch"):
            found.append((node.lineno, repr(node.value)))
    return sorted(set(found))


def test_only_torch_internals_touches_torch_private_names():
    """torch may rename a name starting with `_` in any release: bfexp's uses of them live in
    bfexp.torch_internals alone, where tests/test_torch_internals.py checks each against torch."""
    found = [f"{module}:{line} {what}" for module, tree in _sources().items() if module != "bfexp.torch_internals"
             for line, what in torch_private_uses(tree)]
    assert found == [], f"torch private names outside bfexp.torch_internals: {found}"


def test_a_wheel_ships_every_package():
    """pyproject's package list names every package folder: a wheel (or `pip install .`) ships only
    those, while the editable install of `make` finds any folder, so a missing one fails only for users
    (bfexp.launchers was missing: a wheel install failed at `import bfexp.launchers`)."""
    import tomllib

    root = PACKAGE.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(init.parent.relative_to(root).parts)
               for top in ("bfexp", "hydra_plugins") for init in (root / top).rglob("__init__.py")}
    folders.add("bfexp.conf")  # conf/ at the top, shipped as bfexp.conf (package-dir)
    assert listed == folders, {"not listed": sorted(folders - listed), "listed, no folder": sorted(listed - folders)}
