"""The Responses API's request body (``POST /v1/responses``), as the official ``openai`` client,
Codex CLI and the Agents SDK send it: input items, function tools, text formats, reasoning."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from localllm.api.body import Bool, Float, Int, Int64, RequestBody, check_counts

# ---------------------------------------------------------------- request bodies


class TextContent(RequestBody):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusedContent(RequestBody):
    """Accepted by the schema only to be refused with a clear message."""

    type: Literal["input_image", "input_file", "input_audio", "refusal"]


Content = Annotated[TextContent | RefusedContent, Field(discriminator="type")]


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class ReasoningItem(RequestBody):
    """An earlier turn's reasoning, as clients send it back: dropped."""

    type: Literal["reasoning"]


class ItemReference(RequestBody):
    type: Literal["item_reference"]
    id: str


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference,
    Field(discriminator="type"),
]


class FunctionTool(RequestBody):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: Bool | None = None


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(RequestBody):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    previous_response_id: str | None = None
    store: Bool | None = True
    stream: Bool | None = False
    background: Bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    # localllm's and vLLM's extensions, as on /v1/chat/completions
    seed: Int64 | None = None
    priority: Int64 | None = 0
    speculative: Bool | None = True
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_messages(cls, data):
        """Items without a ``type`` but with a ``role`` are messages (the "easy" input shape)."""
        check_counts(data, messages="input")  # before anything walks the items
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [
                {**item, "type": "message"} if isinstance(item, dict) and "type" not in item and "role" in item
                else item for item in data["input"]]}
        return data
