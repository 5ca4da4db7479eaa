"""Tokenizer, chat template and incremental detokenization.

A GGUF file's vocabulary is read and applied as llama.cpp applies it (:mod:`~localllm.tokenizer.vocab`,
with the pre-tokenizer table of :mod:`~localllm.tokenizer.pretokenizers`): the Rust ``tokenizers``
library runs the merges and regex splits, :mod:`~localllm.tokenizer.encoder` cuts special tokens and
prepares each fragment, and decoding joins llama.cpp's token pieces. A Hugging Face directory's
tokenizer is transformers' own, run through its Rust tokenizer (:mod:`~localllm.tokenizer.hf_tokenizer`).
:class:`Tokenizer` (:mod:`~localllm.tokenizer.core`) is what the engine and the API use. Chat templates
are rendered in a sandboxed Jinja environment (:mod:`~localllm.tokenizer.templates`); fill-in-the-middle
prompts are :mod:`~localllm.tokenizer.fim`'s, text deltas :mod:`~localllm.tokenizer.detokenizer`'s.
"""

from localllm.tokenizer.core import DEFAULT_CHAT_TEMPLATE, Tokenizer
from localllm.tokenizer.detokenizer import IncrementalDetokenizer
from localllm.tokenizer.fim import FimTokens, format_infill

__all__ = ["DEFAULT_CHAT_TEMPLATE", "FimTokens", "IncrementalDetokenizer", "Tokenizer", "format_infill"]
