"""The offline Python API: ``LLM(model=...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import os

from localllm.config.engine import EngineConfig, parse_bytes
from localllm.engine.llm_engine import LLMEngine
from localllm.outputs import CompletionOutput, GenerationOutput
from localllm.sampling_params import SamplingParams
from localllm.store import resolve_models


class LLM:
    """Runs prompts to completion on one in-process engine.

    >>> llm = LLM(model="path/to/model.gguf", device="cpu", dtype="float32")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    >>> out.text, out.token_ids, out.finish_reason
    """

    def __init__(self, model: str | os.PathLike, device: str = "cpu", dtype: str = "auto", **engine_kwargs) -> None:
        """``engine_kwargs``: :class:`~localllm.config.engine.EngineConfig` fields (``kv_cache_memory`` may be a
        size such as ``"512MiB"``). Of the environment only ``LOCALLLM_THREADS`` applies (when ``threads``
        is not given), read now through the settings table; config.toml does not."""
        if "kv_cache_memory" in engine_kwargs:
            engine_kwargs["kv_cache_memory"] = parse_bytes(engine_kwargs["kv_cache_memory"])
        if engine_kwargs.get("threads") is None:
            from localllm.config.settings import env_value

            engine_kwargs["threads"] = env_value("threads")
        self._start(resolve_models(EngineConfig(model=model, device=device, dtype=dtype, **engine_kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM on an engine of ``config`` (e.g. :meth:`localllm.config.settings.Settings.engine_config`'s), its
        model pulled first when it names a catalog or hub model."""
        llm = cls.__new__(cls)
        llm._start(resolve_models(config))
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: int | list[int] = 0,
    ) -> list[GenerationOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * n
        priorities = priority if isinstance(priority, list) else [priority] * n
        engine = self.engine
        req_ids: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        try:
            for prompt, p, prio in zip(prompts, params_list, priorities):
                ids = engine.encode_prompt(prompt)
                rid = engine.add_request(ids, p, priority=prio)
                req_ids.append(rid)
                prompt_ids[rid] = ids
            return self._run(req_ids, prompt_ids)
        except BaseException:
            for rid in req_ids:
                engine.abort(rid)
            raise

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: int | list[int] = 0,
    ) -> list[GenerationOutput]:
        """Like :meth:`generate` for chats (lists of ``{"role", "content"}``), template applied."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params, priority)

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None, priority: int = 0):
        """Yield :class:`~localllm.outputs.RequestOutput` deltas for one prompt or chat as they come.

        Closing the generator early aborts the request.
        """
        engine = self.engine
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.tokenizer.apply_chat_template(prompt)
        rid = engine.add_request(prompt, params, priority=priority)
        try:
            while engine.has_request(rid):
                for out in engine.step():
                    if out.req_id == rid:
                        yield out
        finally:
            engine.abort(rid)

    def _run(self, req_ids: list[str], prompt_ids: dict[str, list[int]]) -> list[GenerationOutput]:
        engine = self.engine
        results = {rid: GenerationOutput(rid, prompt_ids[rid], []) for rid in req_ids}
        pending = set(req_ids)
        while pending:
            for out in engine.step():
                res = results.get(out.req_id)
                if res is None:
                    continue
                while len(res.outputs) <= out.index:
                    res.outputs.append(CompletionOutput(len(res.outputs), [], "", None))
                c = res.outputs[out.index]
                c.token_ids.extend(out.new_token_ids)
                c.text += out.new_text
                c.logprobs.extend(out.new_logprobs)
                res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
                if out.finished:
                    c.finish_reason = out.finish_reason
                if not engine.has_request(out.req_id):
                    pending.discard(out.req_id)
        return [results[r] for r in req_ids]
