"""The CPU backend: GGUF weights repacked for the CPU's vector units, and native AVX-512/AVX2 kernels.

* :mod:`~localllm.kernels.cpu.options`: :class:`CpuOptions`, the environment's switches, read when
  a backend is selected;
* :mod:`~localllm.kernels.cpu.native`: the compiled kernels (``csrc/cpu_kernels.cpp``, built for
  this machine with ``torch.utils.cpp_extension``) and their contract in torch (packing layout,
  reference definitions);
* :mod:`~localllm.kernels.cpu.weights`: GGUF blocks repacked into the native or the int4 layout,
  and which route a weight takes;
* :mod:`~localllm.kernels.cpu.matmul`: the matmuls per call (activation passes, large-batch GEMM,
  LM-head refinement) and the modules that replace the model's quantized linears and embeddings;
* :mod:`~localllm.kernels.cpu.ops`: a decoder layer's other ops on the native kernels (a whole
  decode-step layer in one call), falling back to the torch reference's;
* :mod:`~localllm.kernels.cpu.backend`: :class:`CpuBackend`, the above as one backend;
* :mod:`~localllm.platform.memory`: handing file pages and heap back to the OS after a repack.

Nothing is imported here, so that importing one of these modules (``memory``, from the GGUF
reader) pulls in no others.
"""
