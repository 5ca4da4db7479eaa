"""Bodies of the routes about a model rather than its generation (OpenAI's field names, vLLM's and
llama-server's extensions): ``/v1/models`` and ``/api/unload``, ``/tokenize``, ``/detokenize`` and
``/tokenizer_info``, ``/v1/embeddings``, ``/v1/rerank``, and the error body every route answers with.
The generation routes' bodies (chat, completions, infill) and the rules all requests follow are
:mod:`localllm.api.openai.protocol`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from localllm.api.body import Bool, Int, RequestBody
from localllm.api.openai.protocol import ChatMessage
from localllm.errors import InvalidRequestError


class ModelCard(BaseModel):
    """OpenAI's model object, with Anthropic's fields beside (``type``, ``display_name``,
    ``created_at``): both SDKs read the same list and ignore what they do not know."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "localllm"
    root: str
    max_model_len: int
    type: Literal["model"] = "model"
    display_name: str
    created_at: str
    # localllm's: whether it is loaded now, its quantization, its size on disk, its context (the
    # served one when loaded, else the one its file's header declares)
    loaded: bool = True
    quant: str | None = None
    size_bytes: int = 0
    context_length: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    # Anthropic's pagination fields (one page: everything)
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class UnloadRequest(RequestBody):
    """``POST /api/unload``: the model to unload."""

    model: str = Field(min_length=1, max_length=512)


class TokenizeRequest(RequestBody):
    """vLLM's shape: either ``prompt`` or ``messages`` (then the chat template is applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False
    # Special-token text in the prompt (<|im_end|>) is that token, as in a completion's prompt;
    # false reads it as plain text (llama-tokenize's --no-parse-special).
    parse_special: Bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): what a client that tokenizes through ``/tokenize`` needs."""

    tokenizer_class: str = "localllm"
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str
    model_max_length: int
    add_bos_token: bool


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------- embeddings

MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    input: str | list[str] | list[Int] | list[list[Int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The texts or token id lists, one per embedding (a 400 when empty or too many)."""
        value = self.input
        items: list = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
        if not items or any(len(x) == 0 for x in items):
            raise InvalidRequestError("input must not be empty (nor hold an empty text)", param="input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequestError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(items)}",
                                      param="input")
        return items


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------- rerank


class RerankRequest(RequestBody):
    """``/v1/rerank`` (Jina's and Cohere's shape: ``documents``, ``top_n``, ``return_documents``) and
    Hugging Face TEI's (``texts``, ``return_text``), as llama-server takes both."""

    model: str | None = None
    query: str
    documents: list[str] | list[dict[str, Any]] | None = None
    texts: list[str] | None = None
    top_n: Int | None = None
    return_documents: Bool | None = False
    return_text: Bool | None = False

    @property
    def tei(self) -> bool:
        return self.texts is not None

    def items(self) -> list[str]:
        """The documents' texts (a 400 when none, or too many)."""
        docs = self.texts if self.texts is not None else self.documents
        param = "texts" if self.texts is not None else "documents"
        if not docs:
            raise InvalidRequestError(f"{param} must be a non-empty list of texts", param=param)
        if len(docs) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequestError(f"at most {MAX_EMBEDDING_INPUTS} documents per request, got {len(docs)}",
                                      param=param)
        texts = []
        for doc in docs:
            text = doc.get("text") if isinstance(doc, dict) else doc
            if not isinstance(text, str):
                raise InvalidRequestError("each document must be a text (or {\"text\": ...})", param=param)
            texts.append(text)
        if self.top_n is not None and self.top_n < 1:
            raise InvalidRequestError(f"top_n must be at least 1, got {self.top_n}", param="top_n")
        return texts
