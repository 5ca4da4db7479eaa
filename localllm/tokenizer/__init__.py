"""Tokenizer, chat template and incremental detokenization for a GGUF model.

The tokenizer is converted from GGUF metadata by ``transformers`` once and cached under
``LOCALLLM_HOME/cache/tokenizers`` (:mod:`~localllm.tokenizer.convert`). Encoding and decoding then use
the Rust ``tokenizers.Tokenizer`` alone, exactly as transformers' fast tokenizer would (its
tokenization modules cost ~10 MiB of resident memory); the transformers tokenizer is still there as
``Tokenizer.hf``, built on first use (:mod:`~localllm.tokenizer.core`). Chat templates are rendered in
a sandboxed Jinja environment (:mod:`~localllm.tokenizer.templates`); fill-in-the-middle prompts are
:mod:`~localllm.tokenizer.fim`'s, text deltas :mod:`~localllm.tokenizer.detokenizer`'s.
"""

from localllm.tokenizer.core import DEFAULT_CHAT_TEMPLATE, Tokenizer
from localllm.tokenizer.detokenizer import IncrementalDetokenizer
from localllm.tokenizer.fim import FimTokens, format_infill

__all__ = ["DEFAULT_CHAT_TEMPLATE", "FimTokens", "IncrementalDetokenizer", "Tokenizer", "format_infill"]
