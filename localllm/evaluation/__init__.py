"""Measuring a model: perplexity and KL divergence against a base run, the way llama.cpp's
``llama-perplexity`` measures them (:mod:`localllm.evaluation.perplexity`), so that a figure
reads the same from either tool."""
