"""``localllm run`` (a one-shot answer or a chat REPL, in-process or through a running server)
and ``localllm bench`` (prefill and decode speed on this machine)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import typer

from localllm.cli.common import DEFAULT_MODEL, fail, setup_logging
from localllm.errors import LocalLLMError
from localllm.sampling_params import StructuredOutput


def _load_llm(model: str, dtype: str | None, max_model_len: int | None, kv_cache_memory: str | None,
              threads: int | None = None, cache_type_k: str | None = None, cache_type_v: str | None = None):
    """An in-process LLM on the settings (config.toml < ``LOCALLLM_*`` < these flags; None: unset)."""
    from localllm import LLM
    from localllm.config.settings import load_settings

    flags = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "kv_cache_memory": kv_cache_memory,
             "threads": threads, "cache_type_k": cache_type_k, "cache_type_v": cache_type_v}
    return LLM.from_config(load_settings(flags).engine_config())


class _RemoteLLM:
    """Streams chats from a running localllm server instead of an in-process engine."""

    def __init__(self, base_url: str, model: str, api_key: str | None) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key

    def stream_text(self, messages, params):
        from localllm.client.http import stream_chat
        from localllm.engine.context_fit import CHAT_OVERFLOW

        body = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "context_overflow": CHAT_OVERFLOW}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.structured is not None and params.structured.kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        yield from stream_chat(self.base_url, self.model, messages, body, self.api_key)


def _remote_for(model: str) -> _RemoteLLM | None:
    from localllm.client.http import server_models
    from localllm.config.settings import load_settings

    settings = load_settings()
    served = server_models(settings.base_url, settings.api_key)
    if not served:
        return None
    wanted = {model, os.path.basename(model)}
    try:
        from localllm.store import canonical_name

        wanted.add(canonical_name(model))
    except LocalLLMError:
        pass
    for name in served:
        if name in wanted:
            return _RemoteLLM(settings.base_url, name, settings.api_key)
    return None


def _stream_reply(llm, messages, params) -> str:
    text = []
    if isinstance(llm, _RemoteLLM):
        pieces = llm.stream_text(messages, params)
    else:
        from localllm.engine.context_fit import CHAT_OVERFLOW, fit_chat

        limit = llm.engine.max_model_len
        fitted = fit_chat(messages, llm.tokenizer.apply_chat_template, limit,
                          min(params.max_tokens or 1, limit // 4), CHAT_OVERFLOW)
        if note := fitted.notice(limit):
            sys.stderr.write(f"({note})\n")
        pieces = (out.new_text for out in llm.stream(fitted.prompt_ids, params))
    for piece in pieces:
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
            text.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


REPL_HELP = """Commands:
  /bye            exit
  /clear          forget the conversation
  /system TEXT    set the system prompt
  /format json    answer with a JSON object (enforced by a grammar); /format text: free text again
  /help           this help
  \"\"\"             start or end a multi-line message"""


def _repl(llm, params, system: str | None) -> None:
    messages: list[dict] = []
    if system:
        messages.append({"role": "system", "content": system})
    typer.echo("Type a message, /help for commands, /bye to exit.", err=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            typer.echo("", err=True)
            continue
        if line.strip().startswith('"""'):
            parts = [line.strip()[3:]]
            while True:
                try:
                    nxt = input("... ")
                except EOFError:
                    break
                if nxt.rstrip().endswith('"""'):
                    parts.append(nxt.rstrip()[:-3])
                    break
                parts.append(nxt)
            line = "\n".join(parts).strip("\n")
        stripped = line.strip()
        if not stripped:
            continue
        if stripped in ("/bye", "/exit", "/quit"):
            break
        if stripped == "/help":
            typer.echo(REPL_HELP)
            continue
        if stripped == "/clear":
            messages = [m for m in messages if m["role"] == "system"]
            typer.echo("Cleared the conversation.", err=True)
            continue
        if stripped.startswith("/system"):
            text = stripped[len("/system"):].strip()
            messages = [m for m in messages if m["role"] != "system"]
            if text:
                messages.insert(0, {"role": "system", "content": text})
            typer.echo("Set the system prompt." if text else "Cleared the system prompt.", err=True)
            continue
        if stripped.startswith("/format"):
            fmt = stripped[len("/format"):].strip().lower()
            if fmt not in ("json", "text"):
                typer.echo("Usage: /format json, or /format text", err=True)
                continue
            params = replace(params, structured=StructuredOutput("json_object") if fmt == "json" else None)
            typer.echo("Answers are JSON objects now." if fmt == "json" else "Answers are free text now.", err=True)
            continue
        if stripped.startswith("/"):
            typer.echo(f"Unknown command {stripped.split()[0]}; /help lists them.", err=True)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream_reply(llm, messages, params)
        except KeyboardInterrupt:
            typer.echo("\n(stopped)", err=True)
            messages.pop()
            continue
        except LocalLLMError as exc:  # (the new message alone over the context: say so, keep the chat)
            typer.echo(f"Error: {exc}", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def run(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name (smollm2:135m), hub name, or path to a .gguf file."),
    prompt: str | None = typer.Argument(None, help="One-shot prompt; without it (and no piped stdin) a chat REPL starts."),
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens to generate per reply."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    dtype: str | None = typer.Option(
        None, "--dtype", help="float32, bfloat16 or float16 activations (default: the configured dtype, float32)."
    ),
    max_model_len: int | None = typer.Option(None, "--max-model-len"),
    kv_cache_memory: str | None = typer.Option(None, "--kv-cache-memory", help="e.g. 512MiB, 2GiB."),
    cache_type_k: str | None = typer.Option(None, "--cache-type-k", "-ctk",
                                               help="The keys' KV cache type: f32, f16, bf16, q8_0, q4_0."),
    cache_type_v: str | None = typer.Option(None, "--cache-type-v", "-ctv", help="The values' KV cache type."),
    local: bool = typer.Option(False, "--local", help="Always load the model in-process, even if a server is up."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: LOCALLLM_THREADS, else every core)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Chat with a model in the terminal, or answer one PROMPT and exit.

    Like Ollama, a localllm server running on the configured address that serves MODEL answers
    instead (no second copy of the model is loaded); otherwise the engine starts in-process."""
    setup_logging(verbose)
    from localllm import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read().strip() or None
        remote = None if local else _remote_for(model)
        if remote is not None:
            llm = remote
        else:
            llm = _load_llm(model, dtype, max_model_len, kv_cache_memory, threads, cache_type_k, cache_type_v)
        if prompt is not None:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            _stream_reply(llm, messages, params)
        else:
            _repl(llm, params, system)
    except LocalLLMError as exc:
        fail(exc.message)
    except KeyboardInterrupt:
        raise typer.Exit(130)


def bench(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name or path to a .gguf file."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Prompt length for the prefill measurement."),
    tokens: int = typer.Option(128, "--tokens", help="Tokens to decode for the decode measurement."),
    dtype: str | None = typer.Option(None, "--dtype", help="Default: the configured dtype (float32)."),
) -> None:
    """Measure prefill and single-stream decode tokens/s of MODEL on this machine."""
    import time

    from localllm import SamplingParams

    try:
        llm = _load_llm(model, dtype, None, "256MiB")
        vocab = llm.engine.model_config.vocab_size
        prompt = [(1000 + i) % vocab for i in range(prompt_tokens)]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        prefill = prompt_tokens / (time.perf_counter() - t0)
        first = None
        n = 0
        for out in llm.stream([1, 2, 3], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
            n += len(out.new_token_ids)
            first = first or time.perf_counter()
        decode = (n - 1) / max(time.perf_counter() - first, 1e-9)
    except LocalLLMError as exc:
        fail(exc.message)
    typer.echo(f"prefill ({prompt_tokens} tokens): {prefill:.1f} tokens/s")
    typer.echo(f"decode  ({tokens} tokens, 1 stream): {decode:.2f} tokens/s")
