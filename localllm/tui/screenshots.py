"""Write the README's screenshots of ``localllm chat`` (SVG) from a real conversation.

    python -m localllm.tui.screenshots MODEL.gguf [OUT_DIR [NAME]]   # default OUT_DIR: docs/

Generates two greedy replies on the in-process engine (which also serves the API, as
``localllm chat`` does), then renders the same conversation at 80x24 and 120x40 into
``tui-80x24.svg`` and ``tui-120x40.svg``. NAME is the model name shown (default: the file's).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

SIZES = ((80, 24), (120, 40))
PROMPTS = ("Write a Python function that reverses a string.", "And in one line of bash?")


async def render(app_factory, conv_id: str, out_dir: Path, sizes=SIZES) -> list[Path]:
    """Open conversation ``conv_id`` in ``app_factory()`` at each size and save an SVG of it."""
    paths = []
    for width, height in sizes:
        app = app_factory()
        async with app.run_test(size=(width, height)) as pilot:
            await app.open_conversation(conv_id)
            await pilot.pause(0.3)
            name = f"tui-{width}x{height}.svg"
            app.save_screenshot(name, str(out_dir))
            paths.append(out_dir / name)
    return paths


async def _main(model: str, out_dir: Path, name: str | None) -> None:
    from localllm.config.engine import EngineConfig
    from localllm.engine.async_engine import AsyncEngine
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import EngineBackend
    from localllm.api.in_process import InProcessServer, served_name
    from localllm.api.router import pool_for_engine
    from localllm.config.settings import load_settings
    from localllm.tui.storage import ChatSettings, SettingsStore

    engine = AsyncEngine.from_config(EngineConfig(model=model, kv_cache_memory=512 << 20))
    name = name or served_name(model)
    try:
        SettingsStore().save(ChatSettings(temperature=0.0, max_tokens=80))
        app = ChatApp(EngineBackend(engine, name))
        async with app.run_test(size=SIZES[0]) as pilot:
            for prompt in PROMPTS:
                await app.send(prompt)
                await app.wait_for_reply()
            await pilot.pause()
            conv_id = app.conversation.id

        server = InProcessServer(load_settings({"port": _port()}), pool_for_engine(engine, name), name)

        def app_factory():
            return ChatApp(EngineBackend(engine, name), api_server=server)

        try:
            for path in await render(app_factory, conv_id, out_dir):
                print(path)
        finally:
            server.close()  # not the engine: pool_for_engine leaves it to its owner
    finally:
        engine.shutdown()


def _port(preferred: int = 11435) -> int:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            return 0
    return preferred


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(__doc__)
    out_dir = Path(argv[1] if len(argv) > 1 else "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["LOCALLLM_HOME"] = os.environ.get("LOCALLLM_SCREENSHOT_HOME") or tempfile.mkdtemp(
        prefix="localllm-shots-"
    )
    asyncio.run(_main(argv[0], out_dir, argv[2] if len(argv) > 2 else None))


if __name__ == "__main__":
    main()
