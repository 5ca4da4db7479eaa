"""Write a benchmark's table into README.md between markers, so the README shows measured figures."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def write_section(name: str, markdown: str, path: Path = README) -> None:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in ``path``
    (README.md by default), or add it at the end."""
    if not path.is_file():
        return
    text = path.read_text()
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
