"""``localllm tray``: a system-tray icon for a running ``localllm serve``.

It talks to the server over its HTTP API only (``/health``, ``/metrics``, ``/v1/models``,
``/api/ps``, ``/api/unload``), never to the engine:

- :mod:`localllm.tray.model` — the pure part: :class:`~localllm.tray.model.ServerStatus` read from the
  API, its :class:`~localllm.tray.model.TrayState` (idle / busy / error) and the menu built from it
  (:func:`~localllm.tray.model.build_menu`), plus the controller that runs a menu entry's action;
- :mod:`localllm.tray.desktop` — best-effort desktop helpers (clipboard, terminal, file opener);
- :mod:`localllm.tray.icon` — the icon drawn with Pillow (no image files);
- :mod:`localllm.tray.app` — the pystray glue and the polling thread;
- :mod:`localllm.tray.render` — the icon and menu rendered to a PNG for the docs.
"""
