"""``docs/configuration.md``, made from the settings table (``python -m localllm.config.reference``).

The table in :mod:`localllm.config.settings` is the one place each setting is defined; this page
and ``localllm config`` are both read off it, and a test checks the page is current.
"""

from __future__ import annotations

from localllm.config.settings import SETTINGS, SOURCES

_SCOPES = {
    "model": "The model",
    "serve": "The server",
    "engine": "The engine",
    "cluster": "Replicas (`serve --replicas`, the `localllm[cluster]` extra)",
    "home": "Where localllm keeps its files (environment only)",
    "store": "Downloads (environment only)",
    "backend": "Kernels, read when an engine selects them (environment only)",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    lines = [
        "# Configuration",
        "",
        "<!-- Made by `python -m localllm.config.reference > docs/configuration.md` from the settings table",
        "     (localllm/config/settings.py); tests/config/test_settings.py checks that it is current. -->",
        "",
        "Each setting takes its value from the strongest of these that sets it: "
        + " < ".join({"default": "the default", "env": "the `LOCALLLM_*` environment", "flag": "the flag"}.get(s, f"`{s}`")
                     for s in SOURCES)
        + ". `config.toml` lives in `LOCALLLM_HOME` (the user's cache folder by default: "
        "`~/.cache/localllm` on Linux), one `name = value` a line; `localllm config` prints every value in effect and where it comes from. The flags are those of "
        "`localllm serve` and `localllm chat`; `run` takes the engine's.",
    ]
    for scope, title in _SCOPES.items():
        rows = [s for s in SETTINGS if s.applies == scope]
        if not rows:
            continue
        lines += ["", f"## {title}", ""]
        if rows[0].in_settings:
            lines += ["| setting | flag | environment | type | default | meaning |", "|---|---|---|---|---|---|"]
            for s in rows:
                flag = f"`{s.flag}`" + (f", `{s.short}`" if s.short else "") if s.flag else ""
                lines.append(f"| `{s.name}` | {_cell(flag)} | `{s.env}` | {_cell(s.type_name)} | `{s.default!r}` | "
                             f"{_cell(s.description)} |")
        else:
            lines += ["| environment | type | default | meaning |", "|---|---|---|---|"]
            for s in rows:
                lines.append(f"| `{s.env}` | {_cell(s.type_name)} | `{s.default!r}` | {_cell(s.description)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - writes the page
    print(markdown(), end="")
