"""The Anthropic Messages API's request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``),
with the bounds that make a bad field a 400 naming it; :mod:`localllm.api.anthropic.serving` serves them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from localllm.api.body import Bool, Float, Int, RequestBody, check_counts, messages_not_empty
from localllm.errors import InvalidRequestError
from localllm.sampling_params import SamplingParams

# Anthropic's temperature range (the OpenAI routes take [0, 2]).
MAX_TEMPERATURE = 1.0


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str


class ImageBlock(RequestBody):
    """Accepted by the schema only to be refused with a clear message."""

    type: Literal["image"]


class DocumentBlock(RequestBody):
    type: Literal["document"]


class ThinkingBlock(RequestBody):
    """Earlier turns' thinking, as clients send it back: dropped (Anthropic drops it too)."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


ToolResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: Bool | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(RequestBody):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(RequestBody):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ThinkingConfig(RequestBody):
    type: str
    budget_tokens: Int | None = None


def _blocks(message: dict) -> list:
    """A raw message's content blocks, with the parts inside its ``tool_result`` blocks."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    inner = [b.get("content") for b in content if isinstance(b, dict) and isinstance(b.get("content"), list)]
    return content + [part for parts in inner for part in parts]


class CountTokensRequest(RequestBody):
    """The body of ``/v1/messages/count_tokens`` (and the prompt part of ``/v1/messages``)."""

    model: str
    messages: Annotated[list[AnthropicMessage], AfterValidator(messages_not_empty)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", "name"}
    thinking: ThinkingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data: Any) -> Any:
        return check_counts(data, _blocks)


class MessagesRequest(CountTokensRequest):
    max_tokens: Int
    stop_sequences: list[str] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    stream: Bool | None = False
    metadata: dict[str, Any] | None = None
    speculative: Bool | None = True  # an extension: false turns speculative decoding off for this request

    def sampling_params(self) -> SamplingParams:
        """Raises InvalidRequestError naming the bad field."""
        t = self.temperature
        if t is not None and not 0.0 <= t <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}", param="temperature"
            )
        stops = list(self.stop_sequences or [])
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if t is None else t,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=stops,
            # Kept in the engine's text so that we can tell which one matched; cut off here.
            include_stop_str_in_output=bool(stops),
            speculative=self.speculative is not False,
        )
