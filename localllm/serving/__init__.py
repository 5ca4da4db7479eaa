"""Serving many models from one process, and the process itself.

* :mod:`~localllm.serving.pool`: the models a server offers and the loaded ones (one
  ``AsyncEngine`` each), keep-alive, eviction, unloading.
* :mod:`~localllm.serving.planner`: what a model's load takes (weights, KV cache, overhead) against
  free memory.
* :mod:`~localllm.serving.service`: the detached server and the systemd/launchd units.

Above the engine, below the HTTP API and the front ends: nothing here knows HTTP, the TUI or the CLI.
"""
