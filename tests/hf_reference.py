"""What transformers computes for a GGUF file: the independent reference of the architecture tests."""

from __future__ import annotations

from pathlib import Path

import torch


def transformers_model(path: Path, **config_overrides):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **config_overrides
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def transformers_reference(path: Path, **config_overrides):
    """``ids -> float64 logits [len(ids), vocab]`` from transformers."""
    model = transformers_model(path, **config_overrides)

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].double()

    return logits
