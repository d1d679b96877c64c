"""`bfexp-topology`: one line and exit 2 on bad input; properties and a PNG otherwise."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bfexp.topology.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["hypercube", "--ranks", "12"], "ranks=12"),
        (["ring", "--ranks", "0"], "ranks=0"),
        (["no_such_graph", "--ranks", "4"], "no_such_graph"),
        (["ring", "--ranks", "8", "--base", "3"], "--base"),
        (["exp2", "--ranks", "8", "--weights", "metropolis"], "undirected"),
        (["exp2", "--ranks", "8", "--weights", "doubly"], "doubly"),
        (["random_regular", "--ranks", "12", "--degree", "2", "--seed", "0"], "disconnected"),
        (["random_regular", "--ranks", "7", "--degree", "3"], "degree=3"),
        (["inner_outer_exp2", "--ranks", "8"], "machines"),
        (["inner_outer_exp2", "--ranks", "8", "--ranks-per-machine", "3"], "ranks_per_machine=3"),
        (["mesh", "--ranks", "12", "--rows", "5"], "rows=5"),
        (["star", "--ranks", "4", "--center", "9"], "center=9"),
        (["ring"], "--ranks"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_prints_properties(capsys):
    main(["ring", "--ranks", "10", "--json"])
    import json

    facts = json.loads(capsys.readouterr().out)
    assert facts["ranks"] == 10 and facts["doubly_stochastic"] and facts["symmetric"]
    assert facts["spectral_gap"] == pytest.approx((2 / 3) * (1 - math.cos(2 * math.pi / 10)), abs=1e-12)


def test_console_script_writes_png(tmp_path: Path):
    exe = shutil.which("bfexp-topology", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "bfexp.topology.cli"]
    out = tmp_path / "pics" / "one_peer.png"
    proc = subprocess.run(
        cmd + ["one_peer_exp2", "--ranks", "8", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "strongly_connected" in proc.stdout and "period" in proc.stdout
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_static_png(tmp_path: Path, capsys):
    out = tmp_path / "mesh.png"
    main(["mesh", "--ranks", "12", "--no-torus", "--out", str(out)])
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "spectral_gap" in capsys.readouterr().out


def test_large_graph_draws_plain_lines(tmp_path: Path, monkeypatch):
    """Above MAX_ARROWS edges a panel the picture draws plain lines (fast at thousands of ranks) and says so."""
    import bfexp.topology.draw as draw
    from bfexp.topology import Exp2

    monkeypatch.setattr(draw, "MAX_ARROWS", 10)
    titles = []
    original = draw._draw_plain

    def spy(ax, xy, senders, receivers, node_size):
        titles.append(len(senders))
        return original(ax, xy, senders, receivers, node_size)

    monkeypatch.setattr(draw, "_draw_plain", spy)
    out = draw.draw(Exp2(16), tmp_path / "exp2.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert titles == [16 * 4]  # exp2 at 16 ranks: 4 out-neighbors each, every edge drawn
