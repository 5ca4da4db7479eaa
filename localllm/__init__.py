"""localllm: a local LLM server with continuous batching, paged KV cache and quantized weights."""

from localllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import localllm` (and the CLI's --help) does not import torch.
    if name == "LLM":
        from localllm.llm import LLM

        return LLM
    raise AttributeError(name)
