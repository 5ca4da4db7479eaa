"""Reasoning models: ``<think>…</think>`` split from the answer into ``reasoning_content``.

Qwen3 and the DeepSeek-R1 distills think before they answer, between ``<think>`` and
``</think>``; their chat templates say so (they mention ``<think>``), and some open the block in
the generation prompt already (the answer then begins inside it). Where the template declares
it, chat completions return the thinking as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``) and only the rest as ``content`` — what vLLM's reasoning parsers
and llama-server's ``reasoning_format: "deepseek"`` do. The request field ``reasoning_format:
"none"`` leaves the text as the model wrote it. Tool calls are parsed from the content only.
"""

from __future__ import annotations

from localllm.engine.tool_formats.calls import skip_space

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("auto", "deepseek", "none")


def template_reasons(chat_template: str) -> bool:
    """Whether the chat template declares ``<think>`` blocks."""
    return OPEN in chat_template or CLOSE in chat_template


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside a ``<think>`` block (the answer starts there)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """``(reasoning or None, content)`` of a whole answer; ``inside``: it began in a block."""
    body = text
    if not inside:
        stripped = body.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        body = stripped[len(OPEN):]
    reasoning, sep, content = body.partition(CLOSE)
    if not sep:  # never closed (cut by max_tokens): all of it was thinking
        return reasoning.strip() or None, ""
    return reasoning.strip() or None, content.lstrip()


class ReasoningStream:
    """Splits a streamed answer into ``(reasoning delta, content delta)`` pairs as text arrives,
    holding back only what may be the start of a marker."""

    def __init__(self, inside: bool) -> None:
        self.state = "reasoning" if inside else "start"
        self.buffer = ""
        self.strip_next = inside  # the whitespace right after <think>
        self.blank = 0  # at the start: the whitespace the buffer opens with, read once however long

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                self.blank = skip_space(self.buffer, self.blank)
                if self.buffer.startswith(OPEN, self.blank):
                    self.buffer = self.buffer[self.blank + len(OPEN):]
                    self.state, self.strip_next = "reasoning", True
                    continue
                head = self.buffer[self.blank:self.blank + len(OPEN)]  # enough to tell
                if head and not OPEN.startswith(head):
                    self.state = "content"
                    continue
                return reasoning, content  # only whitespace, or a prefix of <think>: wait
            if self.state == "reasoning":
                if self.strip_next:
                    self.buffer = self.buffer.lstrip()
                    self.strip_next = not self.buffer
                at = self.buffer.find(CLOSE)
                if at >= 0:
                    reasoning += self.buffer[:at].rstrip()
                    self.buffer = self.buffer[at + len(CLOSE):]
                    self.state, self.strip_next = "content", True
                    continue
                keep = next((k for k in range(min(len(CLOSE) - 1, len(self.buffer)), 0, -1)
                             if CLOSE.startswith(self.buffer[-k:])), 0)
                cut = len(self.buffer[:len(self.buffer) - keep].rstrip())  # trailing spaces may precede </think>
                reasoning += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return reasoning, content
            # content
            if self.strip_next:
                self.buffer = self.buffer.lstrip()
                self.strip_next = not self.buffer
            content += self.buffer
            self.buffer = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer is complete."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest.rstrip(), ""
        return "", rest
