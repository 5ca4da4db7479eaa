"""Logprobs in the API's shapes (:class:`LogprobFormat`): the chat's ``logprobs.content``, the legacy
completions' ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` (generated or echoed), and
vLLM's ``prompt_logprobs``; each token's text decoded once and kept. A logprob of -inf becomes
:data:`~localllm.api.openai.protocol.MIN_LOGPROB`, as OpenAI and vLLM report it.
"""

from __future__ import annotations

from localllm.api.openai.protocol import (
    MIN_LOGPROB,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
)
from localllm.outputs import TokenLogprobs


class LogprobFormat:
    """One model's logprobs as the API writes them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_strs: dict[int, str] = {}

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def chat(self, lps: list[TokenLogprobs]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> ChatTopLogprob:
            s = self.token_str(token_id)
            return ChatTopLogprob(token=s, logprob=max(logprob, MIN_LOGPROB), bytes=list(s.encode()))

        content = []
        for lp in lps:
            t = top(lp.token_id, lp.logprob)
            content.append(
                ChatTokenLogprob(
                    token=t.token,
                    logprob=t.logprob,
                    bytes=t.bytes,
                    top_logprobs=[top(i, v) for i, v in lp.top],
                )
            )
        return ChatLogprobs(content=content)

    def vllm_prompt(self, lps: list[TokenLogprobs | None], k: int) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first), the token and its top
        ``k`` alternatives by id, each with its logprob, rank and text."""
        out: list[dict[str, PromptLogprob] | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                                                     decoded_token=self.token_str(lp.token_id))}
            for rank, (token_id, value) in enumerate(lp.top[:k], start=1):
                entry.setdefault(str(token_id), PromptLogprob(logprob=max(value, MIN_LOGPROB), rank=rank,
                                                              decoded_token=self.token_str(token_id)))
            out.append(entry)
        return out

    def echoed(self, prompt_ids: list[int], lps: list[TokenLogprobs | None], k: int) -> CompletionLogprobs:
        """The legacy completions' logprobs of an echoed prompt: every prompt token, its logprob
        (null for the first) and its top ``k`` (null for the first)."""
        out = CompletionLogprobs()
        offset = 0
        for token_id, lp in zip(prompt_ids, lps):
            s = self.token_str(token_id)
            out.tokens.append(s)
            out.token_logprobs.append(None if lp is None else max(lp.logprob, MIN_LOGPROB))
            out.top_logprobs.append(None if lp is None else
                                    {self.token_str(i): max(v, MIN_LOGPROB) for i, v in lp.top[:k]})
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def completion(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            s = self.token_str(lp.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
            out.top_logprobs.append({self.token_str(i): max(v, MIN_LOGPROB) for i, v in lp.top})
            out.text_offset.append(offset)
            offset += len(s)
        return out
