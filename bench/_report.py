"""Write a benchmark's table into docs/performance.md between markers: the current figures, one
block per benchmark (and machine, where a benchmark names it), replaced when it runs again. The
figures behind a table go to docs/performance.json under the same name, for ``bench/plot.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

PERFORMANCE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
FIGURES = PERFORMANCE.with_suffix(".json")


def write_section(name: str, markdown: str, path: Path = PERFORMANCE, data: dict | None = None) -> None:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in ``path``
    (docs/performance.md by default), or add it at the end; ``data``, the figures, replaces NAME's
    entry in docs/performance.json."""
    if data is not None and path == PERFORMANCE:
        figures = json.loads(FIGURES.read_text()) if FIGURES.is_file() else {}
        figures[name] = data
        FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    if not path.is_file():
        return
    text = path.read_text()
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.DOTALL)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
