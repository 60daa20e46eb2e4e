"""Check the record: every row of the results table validates, every current row's source file
exists, and every reference from ``README.md``, ``docs/*.md`` and ``benchmarks/README.md`` into the
benchmark notebook (a section cited by title: ``benchmarks/README.md`, "Title"``) or into
``benchmarks/results/`` (paths, globs, markdown links) resolves. Exit status 1 on a failure.

    python benchmarks/results_check.py
"""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

ROOT = record.ROOT


def main() -> int:
    bad = []
    rows = record.read()  # validates every row
    for r in record.current(rows):
        if not r.source.startswith("command:") and not (ROOT / r.source).exists():
            bad.append(f"current row's source missing: {r.source} ({r.benchmark} {r.metric})")
    notebook = (ROOT / "benchmarks" / "README.md").read_text()
    headings = [h.strip("# ").strip() for h in notebook.splitlines() if h.startswith("#")]
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
    for doc in docs:
        text = " ".join(doc.read_text().split())  # citations may break across lines
        for title in re.findall(r'benchmarks/README\.md`?,? "([^"]+)"', text):
            if not any(h.startswith(title) for h in headings):
                bad.append(f"{doc.relative_to(ROOT)}: section \"{title}\" not in benchmarks/README.md")
        base = doc.parent
        for path in set(re.findall(r"(?:benchmarks/)?results/[\w./*{},-]+", text)):
            path = path.rstrip(".,)")
            full = path if path.startswith("benchmarks/") else None
            cands = [ROOT / full] if full else [base / path, ROOT / "benchmarks" / path]
            pats = []
            for c in cands:
                s = str(c)
                m = re.search(r"\{([^}]*)\}", s)
                pats += [s[:m.start()] + alt + s[m.end():] for alt in m.group(1).split(",")] if m else [s]
            if not any(glob.glob(p) for p in pats):
                # an output path in a command line (``--json results/x.json``) need not exist
                ctx = text[max(0, text.find(path) - 12):text.find(path)]
                if "--json" in ctx or "--out" in ctx:
                    continue
                bad.append(f"{doc.relative_to(ROOT)}: {path} does not exist")
        for link in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in link and not (base / link).exists():
                bad.append(f"{doc.relative_to(ROOT)}: link {link} does not resolve")
    print(f"{len(rows)} rows, {len(record.current(rows))} current; {len(bad)} problems")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
