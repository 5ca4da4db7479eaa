"""What the operating system is asked for: file pages handed back, the heap's policy and its
trimming, transparent huge pages (:mod:`~localllm.platform.memory`). Read by the kernels, the
model readers and the model pool; reads nothing of localllm but ``config``."""
