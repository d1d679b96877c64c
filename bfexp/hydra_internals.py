"""Every use bfexp makes of Hydra's private code (``hydra._internal``, and the one method it replaces), and why.
No other module of bfexp imports ``hydra._internal`` (tests/test_backends.py holds it to that).

* ``known_mode``: Hydra's run mode read from the command line (below).
* ``flag_actions`` and ``parse_flags``: Hydra's own command-line parser, so that bfexp orders the
  arguments as it accepts them and refuses a bad flag in one line (bfexp.cli.hydra_argument_order,
  refuse_bad_flags); Hydra offers no public parser.
* ``sweep_batches``: a sweep's points as Hydra's basic sweeper splits them (bfexp.cli.sweep_points checks
  every point before the first job runs).
* ``sweep_points_composed_once``: each point of a sweep composed once (below).

The run mode:

Hydra 1.3's ``hydra.main`` composes the whole configuration once only to read ``hydra.mode``
(``Hydra.get_mode``), then composes it again for the run: every ``bfexp`` command paid for two
compositions (about 0.2 s of CPU each, a third of a refused command's time). When the command line
alone decides the mode, ``known_mode`` answers ``get_mode`` from it instead. It decides only when no
configuration beside bfexp's own is searched (no ``--config-dir``/``--config-name``/``--config-path``,
whose files could set ``hydra.mode``) and no override names a ``hydra/`` group; then
``hydra.mode`` is what the overrides set, or unset (Hydra's default: ``-m`` decides), exactly what the
first composition would have found in bfexp's configuration. Otherwise Hydra composes as before.

tests/test_hydra_internals.py fails, naming the method, when Hydra no longer calls ``get_mode`` before
it runs a job or the answer here differs from the composed one.

A sweep's points:

Hydra composes each point of a sweep from scratch every time it needs it
(``ConfigLoaderImpl.load_sweep_config``): the basic sweeper once to check the batch
(``Sweeper.validate_batch_is_legal``), the launcher once to run the job, and bfexp once more to check
every point before the first runs (bfexp.cli.sweep_points): three compositions of about 0.3 s of CPU
per point, which for a sweep of 128 points was two minutes of the driver before any rank started.
``sweep_points_composed_once`` keeps each point's composition for the rest of the command and hands every
caller its own copy; the key is the sweep's own configuration and the point's overrides, all that
``load_sweep_config`` reads besides the configuration files, which a command does not change under itself.
tests/test_hydra_internals.py holds a copy equal to a fresh composition, and checks that a sweep composes
each point once.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Iterator, Sequence


def mode_from_arguments(args: list[str]) -> tuple[bool, Any]:
    """(decided, mode): the ``hydra.mode`` the command line gives, where it alone decides it.
    ``args``: the overrides and flags, as ``hydra.main`` parses them."""
    from hydra.types import RunMode

    mode = None
    for arg in args:
        if arg.startswith(("-c", "--config")):  # -cd, --config-dir=..., -cn, -cp; -c (--cfg) runs nothing anyway
            return False, None
        key, _, value = arg.lstrip("+~").partition("=")
        if key.startswith("hydra/"):
            return False, None
        if key == "hydra.mode":
            if arg.startswith("~") or value.strip().lower() in ("null", ""):
                mode = None
                continue
            try:
                mode = RunMode[value.strip().strip("'\"")]
            except KeyError:  # Hydra's own composition says what is wrong with it
                return False, None
    return True, mode


@contextlib.contextmanager
def known_mode(args: list[str]) -> Iterator[None]:
    """Within: Hydra reads the run mode from ``args`` where they decide it (``mode_from_arguments``),
    instead of composing the configuration once more for it."""
    from hydra._internal.hydra import Hydra

    decided, mode = mode_from_arguments(args)
    if not decided:
        yield
        return
    composing = Hydra.get_mode

    def get_mode(self: Any, config_name: Any, overrides: list[str]) -> Any:
        return mode

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = composing


def flag_actions() -> dict[str, argparse.Action]:
    """Hydra's command-line flags (``-m``, ``--cfg``, ``-cd``, ...) -> their argparse actions."""
    from hydra._internal.utils import get_args_parser

    return dict(get_args_parser()._option_string_actions)


def parse_flags(args: list[str], refuse: Callable[[str], Any]) -> argparse.Namespace:
    """``args`` parsed as Hydra's command line parses them; what its parser refuses goes to ``refuse``
    (its message) instead of Hydra's usage and exit."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.error = refuse  # type: ignore[method-assign]  # this parser only: Hydra makes a new one each call
    return parser.parse_args(args)


def sweep_batches(overrides: Sequence[Any]) -> list[list[list[str]]]:
    """Parsed overrides -> the sweep's jobs, each a list of ``key=value`` overrides, in the batches Hydra's
    basic sweeper runs (all of them in one batch: no max_batch_size)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper.split_arguments(list(overrides), None)


@contextlib.contextmanager
def sweep_points_composed_once() -> Iterator[None]:
    """Within: ``load_sweep_config`` composes each (sweep, point) once and hands each caller a deep copy
    (the launcher writes the job's number into its copy)."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    composing = ConfigLoaderImpl.load_sweep_config
    composed: dict[tuple[int, tuple[str, ...]], tuple[Any, Any]] = {}

    def load_sweep_config(self: Any, master_config: Any, sweep_overrides: list[str]) -> Any:
        key = (id(master_config), tuple(sweep_overrides))
        if key not in composed:  # (the sweep's configuration kept beside it: its id is not reused meanwhile)
            composed[key] = (master_config, composing(self, master_config, sweep_overrides))
        return copy.deepcopy(composed[key][1])

    ConfigLoaderImpl.load_sweep_config = load_sweep_config
    try:
        yield
    finally:
        ConfigLoaderImpl.load_sweep_config = composing
