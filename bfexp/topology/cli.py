"""`bfexp-topology <name> --ranks N [--out file.png] [--weights W] [--<param> V]`: facts and a picture.

Each topology's own parameters come from its config schema (bfexp.config),
so the command accepts exactly what `topology.<param>=...` accepts in an
experiment. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import NoReturn, Sequence

PROG = "bfexp-topology"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _schemas() -> dict[str, type]:
    from bfexp.config import SCHEMAS

    return SCHEMAS["topology"]


def _parser() -> argparse.ArgumentParser:
    """Every topology's parameters as options; ``main`` rejects those the chosen one lacks."""
    from bfexp.config import ALLOWED

    schemas = _schemas()
    p = _Parser(
        prog=PROG,
        description="Print a topology's properties and optionally draw it.",
        epilog=f"topologies: {', '.join(schemas)}",
    )
    p.add_argument("name", help="topology (a conf/topology option)")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks")
    p.add_argument("--out", help="write a picture here (e.g. graph.png)")
    p.add_argument(
        "--ranks-per-machine", type=int, default=0, help="ranks per machine (inner_outer_exp2); 0 = one machine"
    )
    p.add_argument("--matrix", action="store_true", help="also print W(t) for every t in a period")
    p.add_argument("--json", action="store_true", help="print the properties as one JSON object")
    seen: dict[str, list[str]] = {}
    defaults: dict[str, object] = {}
    for option, schema in schemas.items():
        for f in dataclasses.fields(schema):
            if f.name != "name":
                seen.setdefault(f.name, []).append(option)
                defaults.setdefault(f.name, f.default)
    for key, options in seen.items():
        flag = "--" + key.replace("_", "-")
        used_by = "all" if len(options) == len(schemas) else ", ".join(options)
        if isinstance(defaults[key], bool):
            p.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f"({used_by})")
        else:
            p.add_argument(flag, dest=key, type=type(defaults[key]), default=argparse.SUPPRESS,
                           choices=ALLOWED.get(f"topology.{key}"), help=f"({used_by})")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    schemas = _schemas()
    args = _parser().parse_args(argv)
    if args.name not in schemas:
        _fail(f"topology={args.name!r}; allowed: {', '.join(schemas)}")
    fields = {f.name: f.default for f in dataclasses.fields(schemas[args.name]) if f.name != "name"}
    for key in vars(args):
        if key not in fields and key not in ("name", "ranks", "out", "ranks_per_machine", "matrix", "json"):
            allowed = ", ".join("--" + k.replace("_", "-") for k in fields)
            _fail(f"topology={args.name} has no parameter --{key.replace('_', '-')}; allowed: {allowed}")
    params = {key: getattr(args, key, default) for key, default in fields.items()}

    import numpy as np

    from bfexp.topology import build_topology

    try:
        topo = build_topology({"name": args.name, **params}, args.ranks, args.ranks_per_machine)
    except ValueError as exc:
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
            path = topo.draw(args.out)
        except (OSError, ValueError) as exc:
            _fail(f"--out={args.out}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        print(f"picture: {path}", file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":  # pragma: no cover
    main()
