"""Write docs/reference/config.md: every config group, every option and every key, from the code.

A component's constructor signature is its schema (bfexp.components.signature_schema), so the reference is
read from there: each key's type and the constructor's default, beside the value the option's YAML gives
and the YAML's own comment. The top level and the data-only scaling group are dataclasses
(bfexp.schema.Config, ScalingConfig): their fields and the comments above them. The page is checked in;
tests/test_reference.py regenerates it and fails when the checked-in copy differs, and checks that every
key of every composed option is on it.

    python scripts/gen_reference.py            # rewrite docs/reference/config.md
    python scripts/gen_reference.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "reference" / "config.md"
# Component groups in the order a reader meets them; the data-only group and the named studies after.
COMPONENT_GROUPS = ("algorithm", "algorithm/compressor", "topology", "model", "dataset", "optimizer", "engine",
                    "launcher", "logger", "heterogeneity")
HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def yaml_comments(path: Path) -> tuple[str, dict[str, str]]:
    """(the option's header comment, {top-level key: the comment block right above it}) of one YAML file."""
    header: list[str] = []
    keys: dict[str, str] = {}
    block: list[str] = []
    seen_key = False
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        if line.startswith("#"):
            block.append(line[1:].strip())
            continue
        m = re.match(r"([A-Za-z_][\w]*):", line)
        if m:
            if not seen_key:
                header, block = block, []
                seen_key = True
            if block:
                keys[m.group(1)] = " ".join(b for b in block if b)
            block = []
        elif not line.strip():
            if not seen_key and block:  # a blank line ends the header; later blocks may follow it
                header, block = header + block, []
        else:
            block = []
    if not seen_key:
        header = header + block
    paragraphs = " ".join(h if h else "\n\n" for h in header).split("\n\n")  # an empty `#` line parts them
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip()), keys


def dataclass_comments(cls: type) -> dict[str, str]:
    """{field: the comment lines right above it} in a dataclass's source (a field's 'why')."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            block.append(text[1:].strip())
            continue
        m = re.match(r"(\w+):", text)
        if m and block:
            comments[m.group(1)] = " ".join(block)
        block = []
    return comments


def type_words(annotation: Any) -> str:
    """A type as the config's reader needs it: the words bfexp's errors use, else the type's own name."""
    from bfexp.components import describe

    if annotation is inspect.Parameter.empty:
        return "any"
    words = describe(annotation)
    if words.startswith(("typing.", "<")) or "[" in words:
        words = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
    return re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], words)  # torch.Tensor -> Tensor


def cell(value: Any) -> str:
    """A value in a table cell: YAML-like, pipes escaped."""
    if value is inspect.Parameter.empty:
        return "required"
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, bool):
        text = str(value).lower()
    elif value is None:
        text = "null"
    elif isinstance(value, str):
        text = value if value else "''"
    else:
        text = str(value)
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`"


def table(rows: list[tuple[str, ...]], head: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


@functools.lru_cache(maxsize=None)
def composed_node(group: str, option: str) -> dict[str, Any]:
    """The option as Hydra composes it (``+group=option``), interpolations kept as written (``${lr}``);
    composed once per process (the page and its test read it). Callers must not change it."""
    from omegaconf import OmegaConf

    from bfexp.components import compose_shipped

    node = OmegaConf.select(compose_shipped(f"{group}/{option}"), group.replace("/", "."))
    data = OmegaConf.to_container(node, resolve=False)
    assert isinstance(data, dict), (group, option)
    return data


def option_keys(group: str, option: str) -> list[str]:
    """The keys the reference lists for one option: its YAML's and its target's keyword parameters."""
    return [row[0].strip("`") for row in option_rows(group, option)[1]]


def option_rows(group: str, option: str) -> tuple[str, list[tuple[str, ...]]]:
    """(its target, one row per key: key, type, constructor default, this option's value, why)."""
    from bfexp.components import RUNTIME, signature_schema, target_of
    from bfexp.schema import DATA_GROUPS

    node = composed_node(group, option)
    _, comments = yaml_comments(REPO / "conf" / group / f"{option}.yaml")
    if group in DATA_GROUPS:
        cls = DATA_GROUPS[group][option]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        why = dataclass_comments(DATA_GROUPS[group][option].__mro__[-2])  # the base dataclass holds the comments
        rows = []
        for name, f in fields.items():
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            rows.append((f"`{name}`", type_words(hints[name]), cell(default), cell(node.get(name, default)),
                         comments.get(name) or why.get(name, "")))
        return f"`{cls.__module__}.{cls.__qualname__}` (data)", rows
    target = target_of(node, f"{group}.{option}")
    params, hints, _ = signature_schema(target)
    runtime = set(RUNTIME.get(group.split("/")[0] if group != "algorithm/compressor" else "", ()))
    if group == "algorithm/compressor":
        runtime = set()
    rows = []
    names = [n for n in params if n not in runtime] + [k for k in node if k not in params and k not in HYDRA_KEYS]
    for name in names:
        p = params.get(name)
        kind = type_words(hints.get(name, p.annotation)) if p is not None else "a string" if name == "name" else "any"
        default = p.default if p is not None else inspect.Parameter.empty
        value = node[name] if name in node else (default if default is not inspect.Parameter.empty else None)
        default_cell = cell(default) if p is not None else "(the class's)"
        value_cell = cell(value) if name in node else "(default)"
        rows.append((f"`{name}`", kind, default_cell, value_cell, comments.get(name, "")))
    partial = " (`_partial_`: built with its run-time arguments)" if node.get("_partial_") else ""
    return f"`{node['_target_']}`{partial}", rows


def top_level() -> list[str]:
    from bfexp.schema import Config

    hints = typing.get_type_hints(Config)
    why = dataclass_comments(Config)
    rows = []
    for f in dataclasses.fields(Config):
        if f.default is dataclasses.MISSING or f.default == "???":  # a group: its own section
            continue
        rows.append((f"`{f.name}`", type_words(hints[f.name]), cell(f.default), why.get(f.name, "")))
    rows.append(("`resume`", "a folder", "`null`", "Run or finish that run or sweep folder's own command again "
                 "([resume](../how-to/resume-and-failures.md)); given on the command line only."))
    return table(rows, ("key", "type", "default", "what"))


def generate() -> str:
    """The whole page."""
    from bfexp.components import group_options
    from bfexp.config import register_configs
    from bfexp.schema import DATA_GROUPS

    register_configs()
    out = ["# Config reference", "",
           "<!-- Generated by scripts/gen_reference.py from the constructors' signatures and conf/; do not edit. "
           "tests/test_reference.py fails when it is stale. -->", "",
           "Every config group, every option and every key, read from the code: a component's constructor is "
           "its schema (`bfexp.components.signature_schema`), the top level and `scaling` are dataclasses "
           "(`bfexp/schema.py`). *default* is the constructor's (or dataclass's) default, *this option* the "
           "value the option's YAML gives (`(default)`: it leaves the key to the constructor; "
           "`${lr}` and the like are resolved when the job is composed). Keys bfexp passes at run time "
           "(the rank count, the model's input shape, the engine, ...) are left out: a YAML may not set them. "
           "`bfexp --cfg job algorithm=dsgd` prints a composed option; `bfexp --help` lists the options.", "",
           "## Top level", "", "Given as `bfexp ranks=8 lr=0.05` (defaults from `bfexp.schema.Config`; `conf/config.yaml` "
           "sets `ranks: 4`, `steps: 200`, `batch_size: 32`, `lr: 0.2` over them).", ""]
    out += top_level()
    for group in (*COMPONENT_GROUPS, *DATA_GROUPS):
        pick = "+algorithm/compressor=NAME" if group == "algorithm/compressor" else f"{group}=NAME"
        out += ["", f"## {group}", "", f"Options: {', '.join(f'`{o}`' for o in group_options(group))} "
                f"(`{pick}`).", ""]
        for option in group_options(group):
            header, _ = yaml_comments(REPO / "conf" / group / f"{option}.yaml")
            target, rows = option_rows(group, option)
            out += [f"### {group}={option}", "", f"{target}. {header}".rstrip(), ""]
            out += table(rows, ("key", "type", "default", "this option", "what")) if rows else ["No keys."]
            out.append("")
    out += ["## experiment", "", "Named studies, run as `bfexp -m +experiment=comm_efficient`: each a `# @package _global_` YAML "
            "that sets the whole study, its sweep included; the claims and results are on the "
            "[studies](../studies/README.md) pages.", ""]
    for option in group_options("experiment"):
        header, _ = yaml_comments(REPO / "conf" / "experiment" / f"{option}.yaml")
        out += [f"- `{option}`: {header.split(chr(10))[0]}"]  # its first paragraph
    slurm = REPO / "conf" / "hydra" / "launcher" / "slurm.yaml"
    header, _ = yaml_comments(slurm)
    out += ["", "## hydra/launcher=slurm", "", f"{header} See [clusters](../how-to/clusters.md).", ""]
    return "\n".join(line.rstrip() for line in out).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Write docs/reference/config.md from the code.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in page differs")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    text = generate()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is stale: run python scripts/gen_reference.py", file=sys.stderr)
            sys.exit(1)
        return
    part = OUT.with_name(f".{OUT.name}.part")  # written whole, then moved over: a reader (the reference
    part.write_text(text)                      # test, beside `make docs` in .ci/run) never sees half of it
    os.replace(part, OUT)
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
