"""Configuration, the bottom room: every room may read it, it reads no room.

* :mod:`localllm.config.engine`: ``EngineConfig`` and ``SchedulerConfig``, the defaults they share
  (block size, token budget, context cap, KV cache size), ``parse_bytes``.
* :mod:`localllm.config.settings`: the one table of settings and ``LOCALLLM_*`` variables, the one
  reader of the environment and config.toml, and the one bool parser.
* :mod:`localllm.config.paths`: where models, caches and logs live (``LOCALLLM_HOME``).
"""
