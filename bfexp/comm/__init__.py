"""Communication engines behind one contract (bfexp.comm.engine.Engine), and how bfexp finds them.

An engine is a class and a YAML. The class (an Engine subclass) states what it is as class attributes:
``name`` (what summaries call it), ``virtual`` (ranks are threads of one process), ``processes`` (one OS
process per rank, started by mpiexec), ``device_type`` ("cpu", "cuda") and ``stacked`` (one engine object
holds every rank), and answers ``available(ranks)``. A conf/engine/<option>.yaml, shipped or in a user's
own config dir, names the class with ``_target_``; its constructor is the option's schema. Everything
that asks what an engine is asks its class, found through the job's node (``engine_class(cfg.engine)``,
``engine_facts(cfg.engine)``); a user's engine therefore needs no other file. Where an engine is named
by a word (``bfexp-run --engine NAME``, ``bf.init(engine=NAME)``, $BFEXP_ENGINE), the word is a shipped
option (conf/engine/NAME.yaml names its class) or a class's dotted path (``mylab.engines.Counting``).

The driver reads these facts before it imports torch (it starts a job's MPI ranks while torch loads,
bfexp.sessions), and every engine module imports torch. So ``engine_facts`` reads the facts a class
states in its own body and its bases' (plain literals, in method-resolution order) from their source,
without running it: the class stays the one place a fact is written, and knowing it costs parsing a
file, not importing torch. What the source does not state plainly (a computed value, a decorated class,
a base it cannot follow) is read from the imported class instead, which is always right, only slower.
Importing bfexp.comm itself initializes neither MPI nor CUDA nor imports torch.

``engine=auto`` names ``Auto`` below: the driver asks it for each job's choice among the shipped
engines, which it tells apart by their facts (bfexp.preflight.choose_engine).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from bfexp.errors import ConfigError, number_in

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.comm.engine import Engine

__all__ = ["KINDS", "PROCESS_ENGINES", "Auto", "Facts", "engine_class", "engine_facts", "engine_options", "engine_path",
           "shipped_engine"]

WHAT = "a shipped option ({}) or an Engine class's path, e.g. mylab.engines.MyEngine"


@functools.lru_cache(maxsize=None)
def engine_options() -> dict[str, str]:
    """The shipped engines: option name -> the class path its conf/engine/<option>.yaml names (``_target_``);
    engine=auto's chooser is not one. Read from the YAMLs: nothing is imported."""
    from importlib import resources

    from omegaconf import OmegaConf

    from bfexp.conf import options

    folder = resources.files("bfexp.conf").joinpath("engine")
    out = {}
    for option in options("engine"):
        target = str(OmegaConf.create(folder.joinpath(f"{option}.yaml").read_text()).get("_target_", ""))
        if target and target != f"{__name__}.{Auto.__name__}":
            out[option] = target
    return out


def engine_path(engine: Any) -> str:
    """The class path of an engine given as a config node (its ``_target_``), a shipped option's name, a class
    path, or the name of an Engine class imported already (``_named``); ConfigError for anything else."""
    if isinstance(engine, Mapping):  # a plain dict or an OmegaConf DictConfig
        target = engine.get("_target_")
        if not target:
            raise ConfigError("engine has no _target_; allowed: an engine node naming its class, e.g. "
                              "engine._target_=mylab.engines.MyEngine (see conf/engine/)")
        return str(target)
    name = str(engine)
    options = engine_options()
    if name in options:
        return options[name]
    if "." in name.strip(".") and all(part.isidentifier() for part in name.split(".")):
        return name
    named = _named(name)
    if named is not None:
        return f"{named.__module__}.{named.__qualname__}"
    raise ConfigError(f"engine={name}; allowed: {WHAT.format(', '.join(options))}")


def engine_class(engine: Any) -> "type[Engine]":
    """The Engine class of ``engine`` (a config node, a shipped option's name or a class path), imported now;
    ConfigError for one that is none."""
    path = engine_path(engine)
    cls = _imported(path)
    from bfexp.comm.engine import Engine

    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"engine={path} is not an Engine class; allowed: "
                          f"{WHAT.format(', '.join(engine_options()))}")
    return cls


def _named(name: str) -> "type[Engine] | None":
    """The one Engine class imported so far that names itself ``name`` in its own body: a job's own engine by the
    name its summary and ``cfg.engine.name`` give, once its node's ``_target_`` imported it (the driver's checks
    do, before anything asks by name). Asking by the node (``engine_class(cfg.engine)``) needs no such import."""
    base = getattr(sys.modules.get("bfexp.comm.engine"), "Engine", None)
    found, todo = [], [base] if base is not None else []
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if vars(sub).get("name") == name and "<locals>" not in sub.__qualname__ and sub not in found:
                found.append(sub)
    if len(found) > 1:
        raise ConfigError(f"engine={name} names {len(found)} classes ("
                          f"{', '.join(f'{c.__module__}.{c.__qualname__}' for c in found)}); allowed: one of their paths")
    return found[0] if found else None


def _imported(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"engine={path} cannot be imported ({type(e).__name__}: {e}); allowed: "
                          f"{WHAT.format(', '.join(engine_options()))}") from None


# ------------------------------------------------------------------ an engine's facts, without importing it


@dataclass(frozen=True)
class Facts:
    """What an engine class states about itself (bfexp.comm.engine.Engine's class attributes)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("name", "virtual", "processes", "device_type", "stacked")

    name: str
    virtual: bool  # ranks are threads of one process
    processes: bool  # one OS process per rank, started by mpiexec
    device_type: str  # where its tensors live: "cpu" or "cuda"
    stacked: bool  # one engine object holds every rank (bfexp.comm.stacked)


def engine_facts(engine: Any) -> Facts:
    """The facts of ``engine`` (a config node, a shipped option's name or a class path): read from its class's
    source where it states them plainly, else from the class imported (see the module doc)."""
    path = engine_path(engine)
    module, _, attr = path.rpartition(".")
    stated = None if module in sys.modules else _stated(path)
    if stated is None or any(not isinstance(stated.get(f), (str, bool)) for f in Facts.FIELDS):
        cls = engine_class(path)
        return Facts(**{f: getattr(cls, f) for f in Facts.FIELDS})
    return Facts(**{f: stated[f] for f in Facts.FIELDS})


# A class attribute assigned something that is not a literal: its value is known only by running the class.
_UNKNOWN = object()
# Bases whose source says nothing about engines (and need not be followed).
_OPAQUE = ("builtins.", "abc.", "typing.")


@functools.lru_cache(maxsize=None)
def _module_source(module: str) -> tuple[ast.Module, dict[str, str]] | None:
    """A module's syntax tree and what its top-level names refer to (imports, its own classes), unrun;
    None where it has no Python source."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), spec.origin)
    except (OSError, SyntaxError, ValueError):
        return None
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = f"{module}.{node.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else \
                    alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module sits in
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return tree, names


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return f"{head}.{expr.attr}" if head else None
    return None


@functools.lru_cache(maxsize=None)
def _class_source(path: str) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """(the literal class attributes the class at ``path`` assigns in its body, its bases' paths), or None
    where its source cannot be read or its bases followed."""
    module, _, attr = path.rpartition(".")
    found = _module_source(module)
    if found is None:
        return None
    tree, names = found
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attr]
    if len(classes) != 1 or classes[0].decorator_list or classes[0].keywords:  # redefined, decorated, a metaclass
        return None
    cls = classes[0]
    own: dict[str, Any] = {}
    for node in cls.body:
        target, value = None, None
        if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__init_subclass__":
            return None  # it may set its subclasses' attributes
        if target is not None:
            try:
                own[target] = ast.literal_eval(value)
            except ValueError:
                own[target] = _UNKNOWN
    bases = []
    for expr in cls.bases:
        dotted = _dotted(expr)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in names:
            bases.append(f"{names[head]}.{rest}" if rest else names[head])
        elif head == "object" and not rest:
            continue
        else:
            return None
    return own, tuple(bases)


def _linearization(path: str, seen: tuple[str, ...] = ()) -> list[str] | None:
    """The method-resolution order (C3) of the class at ``path``, from source; None where it cannot be told."""
    if path.startswith(_OPAQUE):
        return [path]
    read = _class_source(path)
    if read is None or path in seen:
        return None
    orders = []
    for base in read[1]:
        order = _linearization(base, (*seen, path))
        if order is None:
            return None
        orders.append(order)
    orders.append(list(read[1]))
    out = [path]
    while any(orders):
        head = next((o[0] for o in orders if o and not any(o[0] in other[1:] for other in orders)), None)
        if head is None:
            return None  # no consistent order: Python refuses such a class too
        out.append(head)
        orders = [o[1:] if o and o[0] == head else o for o in orders]
    return out


def _stated(path: str) -> dict[str, Any] | None:
    """The class attributes the class at ``path`` has by its source (the first class in its MRO that assigns
    each); None where the source cannot tell."""
    order = _linearization(path)
    if order is None:
        return None
    out: dict[str, Any] = {}
    for cls in order:
        if cls.startswith(_OPAQUE):
            continue
        for key, value in _class_source(cls)[0].items():
            out.setdefault(key, value)
    return out


# The kinds of shipped engine that engine=auto and the library tell apart, by their classes' facts.
KINDS: dict[str, Callable[[Facts], bool]] = {
    "gpu": lambda f: f.processes and f.device_type == "cuda",  # a process per rank, each with its own GPU
    "processes": lambda f: f.processes and f.device_type == "cpu",  # a process per rank on CPU
    "stacked": lambda f: f.stacked,  # every rank in one batched program
    "threads": lambda f: f.virtual and not f.stacked,  # virtual ranks as threads of one process
}


def shipped_engine(kind: str) -> str | None:
    """The first shipped engine option (by name) of ``kind`` (KINDS), or None where none is: what engine=auto
    chooses among, and what the library starts by default. Reads only as many engines' facts as it takes."""
    return next((option for option in engine_options() if KINDS[kind](engine_facts(option))), None)


def __getattr__(name: str) -> Any:
    """``PROCESS_ENGINES``: the shipped options whose ranks are processes (by their classes' facts). For a
    job, ask its node instead (``engine_facts(cfg.engine).processes``): a user's engine is no shipped option."""
    if name == "PROCESS_ENGINES":
        return frozenset(option for option in engine_options() if engine_facts(option).processes)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ engine=auto


class Auto:
    """``engine=auto``: the driver chooses the engine of each job among the shipped ones
    (bfexp.preflight.choose_engine) and prints why: a GPU engine when every rank has its own GPU; else the CPU
    engine whose ranks are processes while the ranks fit the processor slots times ``slots_factor``; else the
    stacked engine when the job can be stacked (bfexp.preflight.stacking_refusal: the checks engine=stacked
    makes), else virtual ranks as threads. Its other settings go to the engine it chooses (``choice``)."""

    name: ClassVar[str] = "auto"

    def __init__(self, ranks_per_machine: int = 0, timeline: bool = False, mpiexec_args: tuple[str, ...] = (),
                 slots_factor: float = 4.0) -> None:
        """``ranks_per_machine`` (0: one machine), ``timeline`` and ``mpiexec_args`` (the last only where the
        chosen engine's ranks are processes) as the chosen engine takes them; ``slots_factor``: MPI ranks per
        processor slot (core) before auto switches to threads."""
        self.ranks_per_machine = number_in("engine.ranks_per_machine", ranks_per_machine, low=0, integer=True)
        self.timeline = timeline
        self.mpiexec_args = [str(a) for a in mpiexec_args]
        self.slots_factor = number_in("engine.slots_factor", float(slots_factor), low=0, low_open=True)

    def choice(self, name: str) -> dict[str, Any]:
        """The config node of the shipped engine ``name`` with this node's settings that it takes."""
        facts = engine_facts(name)
        node: dict[str, Any] = {"_target_": engine_path(name), "name": facts.name,
                                "ranks_per_machine": self.ranks_per_machine, "timeline": self.timeline}
        if facts.processes:
            node["mpiexec_args"] = list(self.mpiexec_args)
        return node
