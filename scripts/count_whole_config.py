"""Which functions of bfexp/ take the job's whole config (issue 47: at most 10, the entry points).

    python scripts/count_whole_config.py

A function takes the whole config when one of its parameters is named ``cfg``: bfexp's name for the composed
top level of a job (Hydra's callbacks and launcher plugins receive theirs as ``config``, in the signatures Hydra
dictates; they are not counted). Printed: the count, then each as module:line name.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bfexp"
NAMES = {"cfg"}


def whole_config_functions(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if NAMES & {a.arg for a in args}:
                    found.append(f"{path.relative_to(package.parent).with_suffix('')}:{node.lineno} {node.name}")
    return found


if __name__ == "__main__":
    functions = whole_config_functions()
    print(len(functions))
    print("\n".join(functions))
