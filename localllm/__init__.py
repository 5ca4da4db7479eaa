"""localllm: a local LLM server with continuous batching, paged KV cache and quantized weights."""

import importlib.metadata

from localllm.sampling_params import SamplingParams

try:
    __version__ = importlib.metadata.version("localllm")  # pyproject.toml's, defined once
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import localllm` (and the CLI's --help) does not import torch.
    if name == "LLM":
        from localllm.llm import LLM

        return LLM
    raise AttributeError(name)
