"""The GPU backend: Triton kernels over the same GGUF blocks and paged KV cache as the reference.

* :mod:`~localllm.kernels.triton.backend`: ``TritonBackend``, the modules it swaps in and its ops;
* :mod:`~localllm.kernels.triton.blocks`: GGUF blocks decoded inside a kernel;
* :mod:`~localllm.kernels.triton.quant`: the dequant-fused matmuls;
* :mod:`~localllm.kernels.triton.kv`: KV-cache writes and 8-bit KV;
* :mod:`~localllm.kernels.triton.attention`: paged attention;
* :mod:`~localllm.kernels.triton.ops`: norms, activations, RoPE;
* :mod:`~localllm.kernels.triton.spec`: the card's limits the launchers choose from (``GpuSpec``);
* :mod:`~localllm.kernels.triton.compile`: every launch compiled for sm_80-90 without a GPU.

Nothing here is imported until the Triton backend is chosen (``kernels.select``), so a CPU-only
install never imports ``triton``; ``spec`` imports no ``triton`` at all.
"""
