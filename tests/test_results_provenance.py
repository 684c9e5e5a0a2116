"""benchmarks/results/NOTES.md accounts for every results file: each file is named in the first
cell of a row that gives its run's command, commit, GPU, versions and date, and each file a row
names is there. A results file added without its row, or a row left behind by a removed file,
fails here."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
NAME = re.compile(r"[\w./-]+\.(?:json|log|yaml|txt|png|csv)")
COLUMNS = ("file", "what it holds", "command of the run", "commit the run executed", "GPU",
           "torch / Triton", "date", "committed in (`git log`)")


def _rows() -> list[list[str]]:
    lines = [ln for ln in (RESULTS / "NOTES.md").read_text().splitlines()
             if ln.startswith("| ") and not ln.startswith("|---")]
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines]


def _named(cell: str) -> list[str]:
    """The files a first cell names, relative to the results folder. A bare name after a
    name in a subfolder lies in that subfolder (`dir/a.json, b.json`)."""
    out, folder = [], ""
    for name in NAME.findall(cell):
        if "/" in name:
            folder = name.rsplit("/", 1)[0] + "/"
            out.append(name)
        else:
            out.append(name if (RESULTS / name).exists() else folder + name)
    return out


def test_the_table_has_its_columns_and_every_row_a_gpu_and_a_date():
    header, *rows = _rows()
    assert tuple(header) == COLUMNS
    assert rows
    for row in rows:
        assert len(row) == len(COLUMNS), row[0]
        assert row[4], f"{row[0]}: no GPU"
        assert re.search(r"\d+\.\d+", row[5]) or row[5] == "-", f"{row[0]}: no versions"
        assert re.search(r"\d{4}-\d{2}-\d{2}", row[6]), f"{row[0]}: no date"


def test_every_results_file_has_a_row_and_every_row_its_files():
    named = {n for row in _rows()[1:] for n in _named(row[0])}
    on_disk = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
               if p.is_file() and p.name != "NOTES.md" and "__pycache__" not in p.parts}
    assert sorted(on_disk - named) == [], "results files without a row in NOTES.md"
    assert sorted(named - on_disk) == [], "rows in NOTES.md naming files that are not there"
