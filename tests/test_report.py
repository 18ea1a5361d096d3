"""The READMEs' numbers come from committed data (benchmarks/report.py): ``--check`` passes on the committed files,
fails naming each table or number that drifted from its data, each unknown marker and each missing run directory,
and rewriting is idempotent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402


def test_the_committed_readmes_match_their_data(capsys):
    code = report.main(["--check"])
    assert code == 0, capsys.readouterr().err


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """The two READMEs copied to tmp_path; report.py pointed at the copies."""
    files = []
    for path in report.FILES:
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
        files.append(copy)
    monkeypatch.setattr(report, "FILES", tuple(files))
    monkeypatch.setattr(report, "ROOT", tmp_path)
    return files


def test_check_names_a_number_that_no_longer_matches_and_the_rewrite_restores_it(copies, capsys):
    readme = next(p for p in copies if p.parent.name == "benchmarks")
    text = readme.read_text()
    marker = "<!-- report:two_gpus_balanced -->"
    assert marker in text and "**1.75x**" in text
    readme.write_text(text.replace("**1.75x**", "**1.88x**", 1))
    assert report.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "report:two_gpus_balanced no longer matches its data" in err and "benchmarks/README.md" in err
    assert readme.read_text() != text  # --check changed nothing
    assert report.main([]) == 0
    assert readme.read_text() == text
    assert report.main([]) == 0 and readme.read_text() == text  # idempotent


def test_check_names_unknown_markers_and_missing_data(copies, capsys, monkeypatch):
    readme = copies[0]
    readme.write_text(readme.read_text() + "\nx <!-- report:no_such_table -->1<!-- /report -->\n")
    monkeypatch.setitem(report.REPORTS, "gone", report.two_gpus_table("no-such-run"))
    readme.write_text(readme.read_text() + "\n<!-- report:gone -->\n<!-- /report -->\n")
    assert report.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "marker report:no_such_table is not in benchmarks/report.py's REPORTS" in err
    assert "report:gone cannot be made from its data: no run directory" in err and "no-such-run" in err


def test_a_marker_shown_in_backticks_is_text():
    text = "`<!-- report:NAME -->` and <!-- report:two_gpus_push_ms -->x<!-- /report -->"
    assert [m["name"] for m in report.MARKER.finditer(text)] == ["two_gpus_push_ms"]


def test_every_generated_number_is_in_a_readme():
    text = "".join(path.read_text() for path in report.FILES)
    unused = [name for name in report.REPORTS if f"<!-- report:{name} -->" not in text]
    assert not unused, f"registered but shown nowhere: {unused}"
