"""``localllm quantize``'s machinery: GPTQ over a whole model (the command is :mod:`localllm.cli.quantize`).

* :mod:`~localllm.quantize.source`: the model to quantize, as float32 HF-layout tensors;
* :mod:`~localllm.quantize.calibration`: calibration text (self-written through the engine's model
  runner and sampler) and running layers on it, collecting each linear's inputs;
* :mod:`~localllm.quantize.export`: writing safetensors, index, config and tokenizer files;
* :mod:`~localllm.quantize.pipeline`: :func:`~localllm.quantize.pipeline.quantize_model`, the entry
  point, and ``export_hf``.

A tool over the whole model, so it sits above the engine (the format and the math it applies live
in :mod:`localllm.quant.gptq`, below the kernels that read the format).
"""
