"""What a new user meets first (issue 44): a slip gets one line that says what to type instead."""

from __future__ import annotations

import pytest

from tests.conftest import run_bfexp


@pytest.mark.parametrize("override, said", [
    ("stpes=3", "unknown key 'stpes' (did you mean 'steps'?)"),
    ("topolgy=ring", "unknown key 'topolgy' (did you mean 'topology'?)"),
    ("algorithm.styl=awc", "unknown key 'algorithm.styl' (did you mean 'style'?)"),
    ("optimizer.momentun=0.9", "unknown key 'optimizer.momentun' (did you mean 'momentum'?)"),
    ("zzz=1", "unknown key 'zzz'; "),
    ("experiment=bandwidth_study", "allowed: +experiment=NAME, NAME one of async_stragglers, bandwidth_study"),
])
def test_a_slip_is_answered_with_what_to_type(tmp_path, override, said):
    proc = run_bfexp([override], tmp_path, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert said in lines[0], lines[0]
    if "did you mean" not in said:
        assert "did you mean" not in lines[0]
