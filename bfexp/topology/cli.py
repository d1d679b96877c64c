"""`bfexp-topology NAME --ranks N [--out file.png] [--<key> V ...]`: facts and a picture.

NAME is a conf/topology option. The command reads that option's YAML from
the packaged config (``bfexp.conf``) and builds it with ``build_topology``,
so it shows exactly the graph a run builds; ``--<key> V`` overrides one of
the YAML's keys, as ``topology.<key>=V`` does in an experiment, and the
value is checked the same way (V is read as YAML: ``--path '[w0.npy, w1.npy]'``;
a mapping merges into a mapping key, ``--graph '{seed: 4}'``, unless it names
another ``_target_``). Your own graph:

    bfexp-topology file --ranks 8 --path dc.edges --direction out --out dc.png
    bfexp-topology generated --ranks 16 --graph '{radius: 0.5, seed: 1}' --out rgg.png

Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys
from typing import Any, NoReturn, Sequence

PROG = "bfexp-topology"
# The command's own arguments; every other one is a key of the option's YAML.
OWN = ("name", "ranks", "out", "ranks_per_machine", "matrix", "json")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def option_names() -> list[str]:
    """The packaged conf/topology options, sorted."""
    folder = importlib.resources.files("bfexp.conf") / "topology"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def option_node(name: str) -> dict[str, Any]:
    """The option's packaged YAML as a plain dict: ``_target_`` and its options with their defaults."""
    from omegaconf import OmegaConf

    with (importlib.resources.files("bfexp.conf") / "topology" / f"{name}.yaml").open("r") as f:
        return OmegaConf.to_container(OmegaConf.load(f), resolve=True)  # type: ignore[return-value]


def _value(text: str) -> Any:
    """A flag's value read as a YAML scalar (3 -> int, true -> bool), as an override would be."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _parser(options: dict[str, dict[str, Any]]) -> argparse.ArgumentParser:
    """Every option's keys as flags; ``main`` rejects those the chosen option lacks."""
    p = _Parser(
        prog=PROG,
        description="Print a topology's properties and optionally draw it.",
        epilog=f"topologies: {', '.join(options)}",
    )
    p.add_argument("name", help="topology (a conf/topology option)")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks")
    p.add_argument("--out", help="write a picture here (e.g. graph.png)")
    p.add_argument(
        "--ranks-per-machine", type=int, default=0, help="ranks per machine (inner_outer_exp2); 0 = one machine"
    )
    p.add_argument("--matrix", action="store_true", help="also print W(t) for every t in a period")
    p.add_argument("--json", action="store_true", help="print the properties as one JSON object")
    used_by: dict[str, list[str]] = {}
    flags: dict[str, bool] = {}  # key -> whether it is a switch (a boolean default)
    for option, node in options.items():
        for key, default in node.items():
            if key != "_target_":
                used_by.setdefault(key, []).append(option)
                flags[key] = flags.get(key, False) or isinstance(default, bool)
    for key, names in used_by.items():
        flag = "--" + key.replace("_", "-")
        where = f"({'all' if len(names) == len(options) else ', '.join(names)})"
        if flags[key]:
            p.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=where)
        else:
            p.add_argument(flag, dest=key, type=_value, default=argparse.SUPPRESS, help=where)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = {name: option_node(name) for name in option_names()}
    args = _parser(options).parse_args(argv)
    if args.name not in options:
        _fail(f"topology={args.name!r}; allowed: {', '.join(options)}")
    node = options[args.name]
    keys = [k for k in node if k != "_target_"]
    for key, value in vars(args).items():
        if key in OWN:
            continue
        if key not in keys:
            allowed = ", ".join("--" + k.replace("_", "-") for k in keys) or "none"
            _fail(f"topology={args.name} has no parameter --{key.replace('_', '-')}; allowed: {allowed}")
        old = node.get(key)
        if isinstance(old, dict) and isinstance(value, dict) and value.get("_target_") in (None, old.get("_target_")):
            value = {**old, **value}  # --graph '{seed: 4}': another argument, the same function
        node[key] = value
    unset = [k for k in keys if node[k] == "???"]  # a YAML's mandatory value (Hydra's ???)
    if unset:
        _fail(f"topology={args.name} needs --{unset[0].replace('_', '-')}; allowed: e.g. "
              f"{PROG} {args.name} --ranks {args.ranks} --{unset[0].replace('_', '-')} VALUE")

    import numpy as np

    from bfexp.errors import ConfigError
    from bfexp.topology import build_topology

    try:
        topo = build_topology(node, args.ranks, args.ranks_per_machine)
    except ConfigError as exc:
        _fail(str(exc))
    facts = topo.describe()
    if args.json:
        print(json.dumps(facts))
    else:
        width = max(map(len, facts))
        for key, value in facts.items():
            if isinstance(value, float):
                value = f"{value:.6g}"
            elif isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            print(f"{key:<{width}}  {value}")
    if args.matrix:
        with np.printoptions(precision=3, suppress=True, linewidth=200):
            for t in range(topo.period):
                print(f"W({t}) =\n{topo.mixing_matrix(t)}")
    if args.out:
        try:
            path = topo.draw(args.out, spectral_gap=facts.get("spectral_gap"))
        except (OSError, ValueError) as exc:
            _fail(f"--out={args.out}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        print(f"picture: {path}", file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":  # pragma: no cover
    main()
