"""The package's structure: no import cycles, counting imports made inside functions (which
import-linter's layer contracts do not see between modules of one package), bounded modules, and a
tree that speaks of what the project does rather than how it was made."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return found


def _why(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    inside = set(component)
    return [f"{a} -> {b} (line {d['line_number']}: {d['line_contents']})"
            for a in component for b in sorted(graph.find_modules_directly_imported_by(a) & inside)
            for d in graph.get_import_details(importer=a, imported=b)]


def test_no_module_is_in_an_import_cycle():
    graph = grimp.build_graph("localllm", include_external_packages=False)
    cycles = _cycles(graph)
    assert not cycles, "\n".join(line for c in cycles for line in _why(graph, c))


def test_the_cycle_finder_finds_a_ring_and_a_pair():
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.e"), ("p.e", "p.d"), ("p.c", "p.f")]:
        graph.add_import(importer=a, imported=b)
    assert sorted(_cycles(graph)) == [["p.a", "p.b", "p.c"], ["p.d", "p.e"]]


def test_at_most_six_modules_at_the_package_root():
    """The root holds the offline API, the errors and the request and result types (the tokenizer is
    a package beside them); every other module lives in its room (docs/architecture.md)."""
    from pathlib import Path

    import localllm

    root = Path(localllm.__file__).parent
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= 6, modules


MAX_LINES = 600


def test_no_python_file_over_600_lines():
    """A bound on a module's size: a file that grows past it is split by what it does (the rooms' rows in
    docs/architecture.md say where)."""
    from pathlib import Path

    import localllm

    root = Path(localllm.__file__).parent
    lengths = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


# Words that tell how the project was made rather than what it does: counted or named work periods,
# borrowed hardware, tracker numbers and their goals. History lives in git.
_HISTORY = re.compile(r"""
  \b(?:\d+(?:st|nd|rd|th)|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth
      |\w+teenth|twentieth|thirtieth|fortieth|(?:twenty|thirty|forty)-\w+)\s+(?:session|work\s+period|round)s?\b
  | \b(?:this|last|previous|next|each|per|one)\s+(?:session|work\s+period)\b
  | \b(?:this|last|previous)\s+round\b
  | \blent\b
  | \bthe\s+issue'?s\b
  | \bissues?\s+\#?\d+
  | \bfounding\s+guide\b
""", re.IGNORECASE | re.VERBOSE)
_TEXT_SUFFIXES = (".py", ".md", ".toml", ".cpp", ".h", ".sh", ".yaml", ".yml", ".txt", ".cfg", ".jinja")


def test_the_project_speaks_of_itself_not_of_its_making():
    """Code, comments, tests, docs and benches say what the project does and why; none of them
    counts work periods, names a tracker entry or its goals, or borrowed hardware."""
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=False)
    if listed.returncode != 0:  # not a git checkout (an sdist): walk the tree instead
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    else:
        names = listed.stdout.split()
    this = Path(__file__).resolve()
    found = []
    for name in names:
        path = root / name
        if not name.endswith(_TEXT_SUFFIXES) or name.startswith("tests/fixtures/") or path == this:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if (m := _HISTORY.search(line)) is not None:
                found.append(f"{name}:{number}: {m.group()!r}")
    assert not found, "\n".join(found)
