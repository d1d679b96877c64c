"""bfexp's shipped Hydra configs (package data, `bfexp.conf`): one YAML per option of each group."""

from importlib import resources


def options(group: str) -> list[str]:
    """The options shipped in a config group (``engine``, ``algorithm/compressor``, ...): its YAML names, sorted.
    Standard library only: `bfexp --help` lists them without importing Hydra."""
    folder = resources.files(__name__).joinpath(*group.split("/"))
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))
