"""Write docs/results/README.md: every entry of docs/results and the pages (and sections) that
cite it, or the benchmark script that writes it there.

    python scripts/results_index.py          # rewrite the index
    python scripts/results_index.py --check  # exit 1 when an entry is cited nowhere

Run it after adding a run to docs/results; an entry nothing cites is raw data no reader can
find: cite it beside its figures, or remove it (git keeps it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
WRITERS = sorted((REPO / "benchmarks").glob("*.sh"))
HEAD = """# Raw results

The raw data behind the figures in the docs. Each entry is cited by the page and section named,
where its command is written beside its figures (or is written by the script named). This index
is made by `python scripts/results_index.py`.

| entry | cited in |
|---|---|
"""


def citations(name: str) -> list[str]:
    """Where ``name`` is cited: ``page, "section"`` for each page and section, then writers."""
    pattern = re.compile(r"(?<![\w-])" + re.escape(name) + r"(?![\w.-])")
    found: list[str] = []
    for page in PAGES:
        section = ""
        for line in page.read_text().splitlines():
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            if pattern.search(line):
                where = f'{page.name}, "{section}"' if section else page.name
                if where not in found:
                    found.append(where)
    found += [f"written by `benchmarks/{w.name}`" for w in WRITERS if pattern.search(w.read_text())]
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that every entry is cited")
    args = ap.parse_args()
    rows, uncited = [], []
    for entry in sorted(p for p in RESULTS.iterdir() if p.name != "README.md"):
        where = citations(entry.name)
        if not where:
            uncited.append(entry.name)
        more = " (and more)" if len(where) > 3 else ""
        rows.append(f"| `{entry.name}{'/' if entry.is_dir() else ''}` | {'; '.join(where[:3]) or 'not cited'}{more} |")
    if not args.check:
        (RESULTS / "README.md").write_text(HEAD + "\n".join(rows) + "\n")
    for name in uncited:
        print(f"docs/results/{name}: cited nowhere", file=sys.stderr)
    return 1 if uncited else 0


if __name__ == "__main__":
    sys.exit(main())
