"""``python -m localllm.cli ARGS``: the ``localllm`` command."""

from localllm.cli import main

main()
