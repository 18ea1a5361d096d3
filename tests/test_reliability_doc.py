"""docs/reliability.md is generated (docs/make_reliability.py): it has a row for every fault scenario of the harness
(tests/faults.py) and every attack at the CLI and on disk (tests/cli_attacks.py). A scenario added without
regenerating the page fails here (regenerating takes minutes, so the suite only checks the names)."""

from __future__ import annotations

from pathlib import Path

from tests.cli_attacks import ATTACKS
from tests.faults import SCENARIOS

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def test_the_reliability_page_has_a_row_for_every_scenario_and_attack():
    rows = {line.split("|")[1].strip().strip("`") for line in DOC.read_text().splitlines() if line.startswith("| `")}
    missing = [name for name in [*SCENARIOS, *ATTACKS] if name not in rows]
    assert not missing, f"docs/reliability.md lacks {missing}: run PYTHONPATH=. python docs/make_reliability.py"
