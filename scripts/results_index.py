"""Write docs/results/README.md: every entry of docs/results, what it shows, and the pages (and
sections) that cite it, or the code that reads or writes it there.

    python scripts/results_index.py          # rewrite the index
    python scripts/results_index.py --check  # exit 1 when an entry is cited nowhere or undescribed

A page cites an entry by its path (`results/NAME`, `docs/results/NAME`, in a link or a command);
a file entry (a name with an extension) also by its bare name. Code in `tests/`, `benchmarks/`
and `scripts/` counts when it names `docs/results/NAME` (a default output, a file it reads).

What each entry shows is written by hand in the index's second column; a rewrite keeps it. Run
this after adding a run to docs/results, then describe the new row. An entry nothing cites is
raw data no reader can find: cite it beside its figures, or remove it (git keeps it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
INDEX = RESULTS / "README.md"
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
CODE_DIRS = ("tests", "benchmarks", "scripts")
UNDESCRIBED = "(not described yet)"
HEAD = """# Raw results

The raw data behind the figures in the docs: one row per entry, what it shows, and the page and
section that cite it, where its command is written beside its figures. Dates are of 2026; a
commit is the tree that ran. This index is made by `python scripts/results_index.py`, which
keeps the second column; `--check` fails on an entry that nothing cites or that is not described.

| entry | what it shows | cited in |
|---|---|---|
"""
ROW = re.compile(r"^\| `([^`]+?)/?` \| (.*) \| (.*) \|$")


def pattern(name: str, is_file: bool) -> re.Pattern[str]:
    """How a page cites ``name``: its path under results/, or (a file) its bare name."""
    if is_file:
        return re.compile(r"(?<![\w-])" + re.escape(name) + r"(?![\w.-])")
    return re.compile(r"(?<![\w-])results/" + re.escape(name) + r"(?![\w.-])")


def code_files() -> list[Path]:
    files: list[Path] = []
    for d in CODE_DIRS:
        files += sorted(p for p in (REPO / d).rglob("*") if p.suffix in (".py", ".sh") and p.is_file())
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def citations(name: str, is_file: bool, code: list[Path]) -> list[str]:
    """Where ``name`` is cited: ``page, "section"`` for each page and section, then code."""
    pat = pattern(name, is_file)
    found: list[str] = []
    for page in PAGES:
        if not page.exists():
            continue
        section = ""
        for line in page.read_text().splitlines():
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            if pat.search(line):
                where = f'{page.name}, "{section}"' if section else page.name
                if where not in found:
                    found.append(where)
    in_code = re.compile(r"docs/results/" + re.escape(name) + r"(?![\w.-])")
    found += [f"`{p.relative_to(REPO)}`" for p in code if in_code.search(p.read_text(errors="replace"))]
    return found


def descriptions() -> dict[str, str]:
    """What each entry shows, from the index as it is."""
    shown: dict[str, str] = {}
    if INDEX.exists():
        for line in INDEX.read_text().splitlines():
            m = ROW.match(line)
            if m and m.group(2) != UNDESCRIBED:
                shown[m.group(1)] = m.group(2)
    return shown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that every entry is cited and described")
    args = ap.parse_args()
    shown, code = descriptions(), code_files()
    rows, problems = [], []
    for entry in sorted(p for p in RESULTS.iterdir() if p.name != INDEX.name):
        where = citations(entry.name, entry.is_file(), code)
        if not where:
            problems.append(f"docs/results/{entry.name}: cited nowhere")
        if entry.name not in shown:
            problems.append(f"docs/results/{entry.name}: not described in {INDEX.relative_to(REPO)}")
        more = " (and more)" if len(where) > 3 else ""
        rows.append(f"| `{entry.name}{'/' if entry.is_dir() else ''}` | {shown.get(entry.name, UNDESCRIBED)} | "
                    f"{'; '.join(where[:3]) or 'not cited'}{more} |")
    if not args.check:
        INDEX.write_text(HEAD + "\n".join(rows) + "\n")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
