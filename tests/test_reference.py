"""The config reference (docs/reference/config.md) cannot go stale: it is regenerated from the code and
compared with the checked-in page, and every key of every composed option must be on it."""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gen_reference  # noqa: E402  (scripts/ is not a package)

PAGE = REPO / "docs" / "reference" / "config.md"
# Reading every constructor imports torch and composes every option (8 s of CPU): .ci/run, which also rebuilds
# the page (`make docs`) and fails on a difference from the checked-in copy.
pytestmark = pytest.mark.large


@pytest.fixture(scope="module")
def generated() -> str:
    return gen_reference.generate()


def test_checked_in_reference_is_current(generated):
    assert PAGE.read_text() == generated, "docs/reference/config.md is stale: run python scripts/gen_reference.py"


def documented(page: str) -> dict[str, set[str]]:
    """{'group=option': the keys its table lists} as the page reads."""
    found: dict[str, set[str]] = {}
    current = None
    for line in page.splitlines():
        m = re.match(r"### (\S+=\S+)$", line)
        if m:
            current = found.setdefault(m.group(1), set())
        elif current is not None and line.startswith("| `"):
            current.add(line.split("`")[1])
        elif line.startswith("## "):
            current = None
    return found


def test_every_option_file_and_every_composed_key_is_documented(generated):
    """Every YAML of every group (conf/<group>/*.yaml, compressors included) composed by Hydra: each of its
    keys but Hydra's own (`_target_`, `_partial_`) is a row of its option's table."""
    from bfexp.config import DATA_GROUPS

    docs = documented(PAGE.read_text())
    checked = 0
    for path in sorted((REPO / "conf").rglob("*.yaml")):
        group = str(path.parent.relative_to(REPO / "conf"))
        if group == "." or group.startswith(("experiment", "hydra")):  # config.yaml; studies and Hydra's: listed
            continue
        assert group in (*gen_reference.COMPONENT_GROUPS, *DATA_GROUPS), f"{group} is not in the reference"
        name = f"{group}={path.stem}"
        assert name in docs, f"{name} ({path.relative_to(REPO)}) is not documented"
        keys = {k for k in gen_reference.composed_node(group, path.stem) if k not in gen_reference.HYDRA_KEYS}
        assert keys <= docs[name], f"{name}: keys {sorted(keys - docs[name])} not documented"
        checked += 1
    assert checked >= 50, checked
    for option in (p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")):
        assert f"- `{option}`:" in PAGE.read_text(), f"experiment={option} is not listed"
