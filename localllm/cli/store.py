"""The model-store commands of the CLI: ``pull``, ``list``, ``show``, ``rm``, ``cp`` and ``create`` (on
:mod:`localllm.store`).

``register(app)`` adds them to a typer app (:mod:`localllm.cli.commands` calls it). Errors print one line to stderr and exit
with 1 (2 for a malformed name, like any other usage error).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Annotated, Any

import typer

from localllm.cli.common import cli_errors, fail, parameters_text

NAME_HELP = (
    "Model: a catalog name (smollm2:135m), hf.co/OWNER/REPO:QUANT, OWNER/REPO/FILE.gguf, a URL or a path."
)


def register(app: typer.Typer) -> None:
    """Add ``pull``, ``list`` (alias ``ls``), ``show``, ``rm``, ``cp`` and ``create`` to ``app``."""
    app.command("pull", help="Download a model into the local store (resumes; verifies sha256).")(pull_cmd)
    app.command("list", help="List pulled models (--catalog: the models pull knows by name).")(list_cmd)
    app.command("ls", hidden=True)(list_cmd)
    app.command("show", help="Show a model's catalog entry, store record and GGUF metadata.")(show_cmd)
    app.command("rm", help="Remove pulled models from the local store.")(rm_cmd)
    app.command("cp", help="Copy a pulled model under another name (its files hard-linked).")(cp_cmd)
    app.command("create", help="Make a model from a Modelfile (FROM, PARAMETER, SYSTEM, MESSAGE), as ollama "
                "create does.")(create_cmd)


# -- helpers -------------------------------------------------------------------------------


def _console() -> Any:
    from rich.console import Console

    # Not a terminal (pipes, tests): never wrap or truncate names.
    return Console(width=None if sys.stdout.isatty() else 1000, highlight=False)


def human_size(num_bytes: int | None) -> str:
    """Decimal units, like ``ollama list``: 98 MB, 4.4 GB."""
    if num_bytes is None:
        return "?"
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"


def human_ago(when: datetime, now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    seconds = max(0, int((now - when).total_seconds()))
    if seconds < 60:
        return "just now"
    for limit, div, unit in ((3600, 60, "minute"), (86400, 3600, "hour"), (86400 * 30, 86400, "day")):
        if seconds < limit:
            n = seconds // div
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d")


# -- commands ------------------------------------------------------------------------------


def pull_cmd(
    name: Annotated[str, typer.Argument(help=NAME_HELP, show_default=False)],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    from localllm import store

    with cli_errors():
        key = store.canonical_name(name)
        already = store.is_pulled(key)
        path = store.pull(name, progress=not quiet)
        if not path.is_relative_to(store.models_dir()):
            typer.echo(f"{name} is a local path; nothing to pull: {path}")
        elif already:
            typer.echo(f"{key} is already pulled: {path}")
        else:
            size = sum(m.size for m in store.list_models() if m.name == key)
            typer.echo(f"pulled {key} ({human_size(size)}) to {path}")


def list_cmd(
    catalog: Annotated[bool, typer.Option("--catalog", help="List the catalog: every model `pull` knows by "
                                          "name, the shorter names for it, and where its weights live.")] = False,
) -> None:
    from rich.table import Table

    from localllm import store

    if catalog:
        _list_catalog()
        return
    with cli_errors():
        models = store.list_models()
    table = Table(box=None, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("NAME", no_wrap=True)
    table.add_column("SIZE", no_wrap=True)
    table.add_column("QUANT", no_wrap=True)
    table.add_column("MODIFIED", no_wrap=True)
    for m in models:
        table.add_row(m.name, human_size(m.size), m.quant or "-", human_ago(m.modified))
    _console().print(table)


def _list_catalog() -> None:
    """``list --catalog``: one row per catalog tag (sizes where the catalog pins them)."""
    from rich.table import Table

    from localllm import store

    with cli_errors():
        catalog = store.load_catalog()
        rows = []
        for name in catalog.canonical_names():
            ref = catalog.ref(name)
            sizes = [f.size for f in ref.files]
            size = human_size(sum(sizes)) if all(s is not None for s in sizes) else "-"
            source = ref.sources[0].describe() if ref.sources else "-"
            pulled = "yes" if store.is_pulled(name) else "-"
            rows.append((name, ", ".join(catalog.short_names(name)) or "-", ref.quant or "-", size, pulled, source))
    table = Table(box=None, show_edge=False, pad_edge=False, header_style="bold")
    for column in ("NAME", "ALSO", "QUANT", "SIZE", "PULLED", "FROM"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    _console().print(table)


def show_cmd(
    name: Annotated[str, typer.Argument(help=NAME_HELP, show_default=False)],
    template: Annotated[bool, typer.Option("--template", help="Print only the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
    plan: Annotated[bool, typer.Option("--plan", help="Print the memory a load needs (weights, KV cache, "
                                       "overhead) against what is free.")] = False,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="With --plan: the context "
                                                      "to plan for (default: the settings').")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option("--kv-cache-memory", help="With --plan: the KV "
                                                        "cache to plan for, e.g. 512MiB.")] = None,
    device: Annotated[str, typer.Option("--device", help="With --plan: cpu or cuda.")] = "cpu",
) -> None:
    from localllm import store

    with cli_errors():
        info = store.model_info(name)
    if plan:
        _print_plan(info, max_model_len, kv_cache_memory, device)
        return
    meta = info.get("gguf") or {}
    if template:
        if not meta.get("chat_template"):
            fail(f"{info['name']}: no chat template (not pulled, or not in its GGUF metadata)", 1)
        typer.echo(meta["chat_template"])
        return
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    _print_info(info)


def _print_plan(info: dict[str, Any], max_model_len: int | None, kv_cache_memory: str | None, device: str) -> None:
    """``show MODEL --plan``: the memory planner's estimate for loading the model with the settings."""
    from localllm.config.device import resolve_dtype
    from localllm.config.engine import kv_cache_types, parse_bytes
    from localllm.config.settings import load_settings
    from localllm.serving.planner import plan_load, read_model_facts

    if not info.get("path"):
        fail(f"{info['name']}: not pulled, so there is no file to plan from (run `localllm pull {info['name']}`)", 1)
    with cli_errors():
        settings = load_settings({"max_model_len": max_model_len, "kv_cache_memory": kv_cache_memory})
        memory_plan = plan_load(read_model_facts(info["path"]), name=info["name"],
                                kv_cache_memory=parse_bytes(settings.kv_cache_memory),
                                max_model_len=settings.max_model_len,
                                kv_cache_types=kv_cache_types(settings.kv_cache_dtype, settings.cache_type_k,
                                                              settings.cache_type_v),
                                dtype=resolve_dtype(settings.dtype, device), device=device)
    typer.echo(f"  Memory plan for {info['name']}")
    for line in memory_plan.lines():
        typer.echo("  " + line)
    if memory_plan.problem:
        raise typer.Exit(1)


def _print_info(info: dict[str, Any]) -> None:
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, Any]]) -> None:
        rows = [(k, v) for k, v in rows if v not in (None, "", [], {})]
        if rows:
            width = max(len(k) for k, _ in rows) + 2
            lines.extend([f"  {title}", *(f"    {k:<{width}}{v}" for k, v in rows), ""])

    section(
        "Model",
        [
            ("name", info["name"]),
            ("description", info.get("description")),
            ("format", info.get("format")),
            ("quantization", info.get("quant")),
            ("license", info.get("license")),
            ("context length", info.get("context_length")),
        ],
    )
    sources = info.get("sources") or []
    section(
        "Source",
        [("from", sources[0] if sources else None), ("file", ", ".join(info.get("repo_files") or []))]
        + [("fallback", s) for s in sources[1:]],
    )
    files = info.get("files") or []
    pulled = info.get("pulled")
    status = None
    if info.get("kind") == "local":
        status = "local file (used in place)"
    elif pulled:
        try:
            status = "pulled " + human_ago(datetime.fromisoformat(info["pulled_at"]))
        except (KeyError, TypeError, ValueError):
            status = "pulled"
        src = info.get("source") or {}
        if src.get("type") == "pypi-wheel":
            status += f" (from PyPI wheel {src.get('package')}=={src.get('version')})"
        elif src.get("type") == "hf":
            status += f" (from hf.co/{src.get('repo')})"
    elif pulled is False:
        status = f"not pulled (localllm pull {info['name']})"
    section(
        "Store",
        [
            ("status", status),
            ("path", info.get("path")),
            ("size", human_size(info["size"]) if info.get("size") else None),
        ]
        + [(f"sha256 {f['name']}" if len(files) > 1 else "sha256", f.get("sha256")) for f in files],
    )
    meta = info.get("gguf") or {}
    heads = meta.get("head_count")
    if heads is not None and meta.get("head_count_kv") is not None:
        heads = f"{heads} (kv {meta['head_count_kv']})"
    section(
        "GGUF",
        [
            ("architecture", meta.get("architecture")),
            ("name", meta.get("name")),
            ("parameters", parameters_text(meta.get("parameters"), meta.get("active_parameters"), None)),
            ("context length", meta.get("context_length")),
            ("embedding length", meta.get("embedding_length")),
            ("layers", meta.get("block_count")),
            ("attention heads", heads),
            ("vocab size", meta.get("vocab_size")),
            ("file type", meta.get("file_type")),
            ("tensor types", ", ".join(f"{t} ×{n}" for t, n in (meta.get("tensor_types") or {}).items())),
            ("tokenizer", meta.get("tokenizer")),
            ("license", meta.get("license")),
        ],
    )
    template = (meta.get("chat_template") or "").splitlines()
    if template:
        lines.append("  Chat template")
        lines.extend(f"    {line}" for line in template[:8])
        if len(template) > 8:
            lines.append(f"    … ({len(template)} lines; see --template)")
    typer.echo("\n".join(lines).rstrip())


def rm_cmd(names: Annotated[list[str], typer.Argument(help="Models to remove.", show_default=False)]) -> None:
    from localllm import store

    with cli_errors():
        for name in names:
            key = store.remove(name)
            typer.echo(f"deleted {key}")


def cp_cmd(source: Annotated[str, typer.Argument(help="A pulled model.", show_default=False)],
           destination: Annotated[str, typer.Argument(help="Its new name.", show_default=False)]) -> None:
    from localllm.store import local

    with cli_errors():
        typer.echo(f"copied {local.copy(source, destination)}")


def create_cmd(
    name: Annotated[str, typer.Argument(help="The new model's name.", show_default=False)],
    file: Annotated[str, typer.Option("--file", "-f", help="The Modelfile.")] = "Modelfile",
) -> None:
    """A stored variant of the Modelfile's FROM model (a pulled model or a GGUF file's path; its files
    hard-linked) whose chats start from its SYSTEM prompt, MESSAGE examples and PARAMETER values."""
    from pathlib import Path

    from localllm.store import local
    from localllm.store.modelfile import parse_modelfile

    with cli_errors():
        path = Path(file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"cannot read {path}: {exc.strerror or exc}")
        base, defaults = parse_modelfile(text)
        if not Path(base).is_absolute() and (path.parent / base).is_file():  # (a FROM path beside the Modelfile)
            base = str(path.parent / base)
        typer.echo(f"created {local.create(name, base, defaults)}")
