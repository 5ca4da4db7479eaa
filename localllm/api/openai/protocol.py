"""Request and response bodies of the OpenAI-compatible API (OpenAI's field names, vLLM's extensions).

Requests ignore fields they do not know (OpenAI clients send some). Numbers are strict: a
string where a number belongs is a 400, not a silent conversion. Range checks live in
:class:`~localllm.sampling_params.SamplingParams`, so the API and the Python API agree.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from localllm.api.body import Bool, Float, Int, Int64, RequestBody, check_counts, messages_not_empty
from localllm.errors import InvalidRequestError
from localllm.sampling_params import SamplingParams, StructuredOutput
from localllm.tokenizer.templates import RESERVED_TEMPLATE_VARIABLES

# A text completion takes at most this many prompts, and prompts x n samples in all.
MAX_PROMPTS = 256
# Logprobs of -inf are not valid JSON numbers; OpenAI and vLLM report this floor instead.
MIN_LOGPROB = -9999.0


class StreamOptions(RequestBody):
    include_usage: Bool | None = False


class JsonSchemaFormat(RequestBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(RequestBody):
    """vLLM's ``structured_outputs``: one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidRequestError(f"{param} is not valid JSON", param=param) from None
    return json.dumps(schema, sort_keys=True)


def _sampler_knobs(body: Any, repetition_penalty: float | None) -> dict[str, Any]:
    """The sampler's knobs of a chat, completion or infill body (``temperature``, ``top_p``, ``top_k``,
    ``min_p``, the penalties, ``stop``) as SamplingParams arguments, an absent knob at its neutral value."""
    return {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "min_p": body.min_p or 0.0,
        "repetition_penalty": 1.0 if repetition_penalty is None else repetition_penalty,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
    }


class _GenerationRequest(RequestBody):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool | None = False
    priority: Int64 | None = 0
    speculative: Bool | None = True  # false: no speculative decoding for this request
    prompt_logprobs: Int | None = None  # vLLM: the prompt tokens' logprobs and this many alternatives each
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one grammar this request asks for (``None``: free text); two at once is a 400."""
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                          param="response_format")
            found.append(("response_format", StructuredOutput(
                "json_schema", _schema_text(rf.json_schema.schema_, "response_format"))))
        so = self.structured_outputs
        if so is not None:
            given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k)]
            if len(given) != 1:
                raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                          "json_object", param="structured_outputs")
            key = given[0]
            if key == "json_":
                found.append(("structured_outputs", StructuredOutput(
                    "json_schema", _schema_text(so.json_, "structured_outputs"))))
            elif key == "json_object":
                found.append(("structured_outputs", StructuredOutput("json_object")))
            elif key == "choice":
                found.append(("structured_outputs", StructuredOutput("choice", json.dumps(so.choice))))
            else:
                found.append(("structured_outputs", StructuredOutput(key, getattr(so, key))))
        if self.guided_json is not None:
            found.append(("guided_json", StructuredOutput("json_schema", _schema_text(self.guided_json, "guided_json"))))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        if len(found) > 1:
            raise InvalidRequestError(f"give one kind of structured output, got {', '.join(p for p, _ in found)}",
                                      param=found[1][0])
        return found[0][1] if found else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises InvalidRequestError naming the bad field."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                    ) from None
        return SamplingParams(
            max_tokens=max_tokens,
            **_sampler_knobs(self, self.repetition_penalty),
            logit_bias=bias,
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            n=1 if self.n is None else self.n,
            structured=self.structured_output(),
            speculative=self.speculative is not False,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        )


# ---------------------------------------------------------------- chat completions


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCallIn(RequestBody):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(RequestBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that render it

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDef(RequestBody):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], AfterValidator(messages_not_empty)]
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    # reasoning models: "auto" splits <think> blocks where the template declares them (llama-server's names)
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM), e.g. enable_thinking
    # what a conversation over the context does (localllm.engine.context_fit; None: the server's setting)
    context_overflow: Literal["error", "truncate-middle", "rolling-window"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data: Any) -> Any:
        return check_counts(data)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """Variables the server sets itself (the messages, tools, the template's functions) would
        clash with the renderer's own."""
        for key in kwargs or ():
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}: the server sets it",
                                          param="chat_template_kwargs")
        return kwargs

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        try:
            return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        except InvalidRequestError as exc:
            if exc.param == "logprobs":
                exc.param = "top_logprobs"
            elif exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class _ResponseHead(BaseModel):
    """What every OpenAI completion object and stream chunk begins with (a subclass narrows ``object``)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's prompt_logprobs of the rendered prompt (see CompletionChoice); absent unless asked
    prompt_logprobs: list[dict[str, "PromptLogprob"] | None] | None = Field(default=None,
                                                                          exclude_if=lambda v: v is None)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- text completions


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = None
    # Fill-in-the-middle: the text after the insertion point (the prompt is the text before it).
    suffix: str | None = None
    echo: Bool | None = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry of a batch; a single text or token list is a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    @property
    def scores_prompt(self) -> bool:
        """``echo`` with ``logprobs``, or ``max_tokens: 0`` with ``echo`` (lm-evaluation-harness's
        loglikelihood requests): the prompt's tokens come back with their logprobs."""
        return bool(self.echo) and (self.logprobs is not None or self.max_tokens == 0)

    def sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.scores_prompt:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs or 0)
        params = self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)
        num_prompts = len(self.prompts())
        if num_prompts > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {num_prompts}", param="prompt")
        if num_prompts * params.n > MAX_PROMPTS:
            raise InvalidRequestError(
                f"prompts x n must be at most {MAX_PROMPTS}, got {num_prompts} x {params.n}", param="n"
            )
        return params


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one prompt token's entry (and its alternatives') in ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    # vLLM's prompt_logprobs: per prompt token (None for the first), token id -> entry; absent unless asked
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(default=None,
                                                                        exclude_if=lambda v: v is None)


class CompletionResponse(_ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- llama-server's /infill


class InfillExtraChunk(RequestBody):
    """One chunk of repo-level context: another file's text."""

    filename: str = "tmp"
    text: str


class InfillRequest(RequestBody):
    """llama-server's ``POST /infill`` body (the fields editors send; others are ignored)."""

    model: str | None = None
    input_prefix: str
    input_suffix: str
    input_extra: list[InfillExtraChunk] | None = None
    prompt: str | None = None  # appended to the prefix, as llama-server does
    n_predict: Int | None = None  # llama-server's name; -1 for no limit but the context
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repeat_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: Bool | None = False
    priority: Int64 | None = 0

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.n_predict if self.n_predict is not None else self.max_tokens
        if max_tokens is not None and max_tokens < 0:
            max_tokens = None
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                **_sampler_knobs(self, self.repeat_penalty),
                seed=self.seed if self.seed is None or self.seed >= 0 else None,  # -1: random, as llama.cpp
            )
        except InvalidRequestError as exc:
            if exc.param == "max_tokens" and self.n_predict is not None:
                exc.param = "n_predict"
            elif exc.param == "repetition_penalty":
                exc.param = "repeat_penalty"
            raise


class InfillResponse(BaseModel):
    """llama-server's non-OpenAI completion result (its main fields); streamed as chunks with
    ``stop`` false, then a final one with ``stop`` true."""

    index: int = 0
    content: str
    tokens: list[int] = Field(default_factory=list)
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    stop_type: str | None = None  # final only: "eos", "limit" or "word"
    stopping_word: str | None = None
    tokens_cached: int | None = None
    truncated: bool | None = None
