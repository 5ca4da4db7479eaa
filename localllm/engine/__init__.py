"""The engine: one model's requests from submission to text.

* :mod:`~localllm.engine.llm_engine`: ``LLMEngine`` (request lifecycle, stop conditions,
  detokenization, fault isolation, drafts for speculative decoding);
  :mod:`~localllm.engine.async_engine`: ``AsyncEngine`` (its step thread and asyncio fan-out).
* :mod:`~localllm.engine.model_runner` (CPU and torch) and :mod:`~localllm.engine.gpu_runner`
  (CUDA graphs, pinned inputs): a ``SchedulerOutput`` into tensors, the model run, samples.
* :mod:`~localllm.engine.sampler`, :mod:`~localllm.engine.structured` (grammars),
  :mod:`~localllm.engine.embeddings` (pooling and the embedding batcher),
  :mod:`~localllm.engine.speculator` (speculative decoding's drafting) and
  :mod:`~localllm.engine.draft_model` (``--draft-model``), :mod:`~localllm.engine.input_batch` (one
  step's batch as host arrays), :mod:`~localllm.engine.tool_formats`, :mod:`~localllm.config.device`.

It sits above the scheduler, the drafters (``localllm.speculation``), the models and the kernels,
and below the offline API (``localllm.llm``), the serving room and the front ends.
"""
