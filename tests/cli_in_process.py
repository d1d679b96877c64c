"""bfexp's command lines called in this interpreter, for the tests that run dozens of command lines
(tests/test_bad_input.py, tests/test_cli_args.py): one interpreter start instead of one per line."""

from __future__ import annotations

import contextlib
import io
import traceback
from typing import Any


def call(args: list[str]) -> dict[str, Any]:
    """``bfexp ARGS`` here: its exit code, what it printed and any exception that escaped the CLI (a bug),
    with Hydra's and the CLI's state reset for the next call."""
    import bfexp.cli as cli
    from hydra.core.global_hydra import GlobalHydra

    err, out = io.StringIO(), io.StringIO()
    code, escaped = 0, None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            cli.command(args)
        except SystemExit as e:
            code = e.code
        except BaseException:
            escaped = traceback.format_exc()
    GlobalHydra.instance().clear()
    cli.reset_state()
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue(), "escaped": escaped}


MAINS = {"bfexp-report": "bfexp.report", "bfexp-topology": "bfexp.topology.cli"}


def call_main(command: str, args: list[str]) -> dict[str, Any]:
    """Another of bfexp's commands (``bfexp-report``, ``bfexp-topology``) called here with ``args``, as ``call``."""
    import importlib

    main = importlib.import_module(MAINS[command]).main
    err, out = io.StringIO(), io.StringIO()
    code, escaped = 0, None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main(args)
        except SystemExit as e:
            code = e.code
        except BaseException:
            escaped = traceback.format_exc()
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue(), "escaped": escaped}
