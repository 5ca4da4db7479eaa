"""``localllm tokenize``: a model's tokens for a text, as llama-tokenize prints them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from localllm.cli.common import cli_errors, fail


def load_tokenizer(model: str):
    """The tokenizer alone of a catalog name, a .gguf file (a vocabulary-only one too) or a Hugging
    Face directory: no weights are read."""
    from localllm.models.gguf_file import read_gguf
    from localllm.store.download import resolve_model_path
    from localllm.tokenizer import Tokenizer

    if os.path.isdir(model):
        return Tokenizer.from_hf_dir(model)
    path = resolve_model_path(model)
    return Tokenizer(path, read_gguf(path).metadata)


def tokenize(
    model: Annotated[str, typer.Argument(help="Catalog name, .gguf file (a vocabulary-only one too) or Hugging "
                                              "Face directory.")],
    text: Annotated[str | None, typer.Argument(help="The text (or --file, --stdin, --jsonl).")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Read the text from this file (UTF-8).")] = None,
    stdin: Annotated[bool, typer.Option("--stdin", help="Read the text from standard input.")] = False,
    ids: Annotated[bool, typer.Option("--ids", help="Print only the ids, as one list.")] = False,
    no_bos: Annotated[bool, typer.Option("--no-bos", help="Add no BOS (nor EOS) even where the model adds them.")] = False,
    no_parse_special: Annotated[bool, typer.Option(
        "--no-parse-special", help="Read special-token text (<|im_end|>) as plain text.")] = False,
    show_count: Annotated[bool, typer.Option("--show-count", help="Print the number of tokens last.")] = False,
    jsonl: Annotated[str | None, typer.Option(
        "--jsonl", metavar="PATH", help="One JSON string a line in (- for standard input), one JSON list of ids a "
        "line out; no BOS, special-token text not parsed.")] = None,
) -> None:
    """Print the tokens of TEXT for MODEL, as llama-tokenize does: each id with its text, or with
    --ids the list of ids. --jsonl tokenizes many texts, one a line."""
    sources = [s for s in (text is not None, file is not None, stdin, jsonl is not None) if s]
    if len(sources) != 1:
        fail("give the text as an argument, or exactly one of --file, --stdin and --jsonl", 2)
    with cli_errors():
        tokenizer = load_tokenizer(model)
        if jsonl is not None:
            _jsonl(tokenizer, jsonl)
            return
        if file is not None:
            text = file.read_bytes().decode("utf-8")
        elif stdin:
            text = sys.stdin.buffer.read().decode("utf-8")
        tokens = tokenizer.encode(text, add_special_tokens=not no_bos, parse_special=not no_parse_special)
    if ids:
        typer.echo(json.dumps(tokens))
    else:
        pieces = tokenizer.byte_pieces(skip_special_tokens=False)
        for i in tokens:
            piece = (pieces[i].decode("utf-8", "replace") if pieces is not None
                     else tokenizer.decode([i], skip_special_tokens=False))
            typer.echo(f"{i:6d} -> '{piece}'")
    if show_count:
        typer.echo(f"Total number of tokens: {len(tokens)}")


def _jsonl(tokenizer, path: str) -> None:
    lines = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    out = sys.stdout
    try:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)
            except ValueError as exc:
                fail(f"{path}:{number}: not JSON ({exc})", 2)
            if not isinstance(text, str):
                fail(f"{path}:{number}: expected a JSON string, got {type(text).__name__}", 2)
            out.write(json.dumps(tokenizer.encode(text, add_special_tokens=False, parse_special=False)) + "\n")
    finally:
        if lines is not sys.stdin:
            lines.close()
    out.flush()
