"""Render the tray icon's three states and its menu to one PNG, with Pillow (no display needed).

    python -m localllm.tray.render [OUT.png]     # default: docs/tray-menu.png

The menu is :func:`~localllm.tray.model.build_menu` of a sample status (a busy server with two models),
drawn the way a desktop shows it, with the first model's submenu open.
"""

from __future__ import annotations

import sys
from pathlib import Path

from localllm.tray.icon import draw_icon
from localllm.tray.model import LoadedModel, MenuEntry, ServerStatus, TrayState, build_menu

SAMPLE_STATUS = ServerStatus(
    "http://127.0.0.1:11435", reachable=True, healthy=True, num_running=1,
    models=(LoadedModel("smollm2:135m", "Q4_1", 100_000_000, num_running=1),
            LoadedModel("qwen2.5:0.5b", "Q8_0")),
)

ROW_H = 26
PAD = 12
BG = (246, 246, 246)
PANEL = (255, 255, 255)
BORDER = (200, 200, 200)
TEXT = (30, 30, 30)
MUTED = (150, 150, 150)
HIGHLIGHT = (225, 236, 252)


def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _menu_height(entries: tuple[MenuEntry, ...]) -> int:
    return sum(9 if e.is_separator else ROW_H for e in entries) + 8


def _draw_menu(d, entries: tuple[MenuEntry, ...], x: int, y: int, width: int, open_label: str | None):
    """Draw ``entries`` as a menu panel at (x, y); the y of the row labelled ``open_label``."""
    font = _font(14)
    d.rectangle((x, y, x + width, y + _menu_height(entries)), fill=PANEL, outline=BORDER)
    row_y, open_y = y + 4, None
    for entry in entries:
        if entry.is_separator:
            d.line((x + 8, row_y + 4, x + width - 8, row_y + 4), fill=BORDER)
            row_y += 9
            continue
        if entry.label == open_label:
            d.rectangle((x + 2, row_y, x + width - 2, row_y + ROW_H - 1), fill=HIGHLIGHT)
            open_y = row_y
        color = TEXT if entry.enabled else MUTED
        d.text((x + 12, row_y + 5), entry.label, font=font, fill=color)
        if entry.submenu:
            d.text((x + width - 20, row_y + 5), ">", font=font, fill=color)
        row_y += ROW_H
    return open_y


def render_tray_image(status: ServerStatus = SAMPLE_STATUS):
    """The docs picture: the three icons, labelled, above the menu for ``status``."""
    from PIL import Image, ImageDraw

    menu = build_menu(status)
    open_entry = next(e for e in menu if e.submenu)
    menu_w, sub_w = 340, 120
    width = PAD * 3 + menu_w + sub_w
    icons_h = 64 + 30
    height = PAD * 3 + icons_h + _menu_height(menu)
    img = Image.new("RGB", (width, height), BG)
    d = ImageDraw.Draw(img)
    label_font = _font(13)
    for i, state in enumerate(TrayState):
        x = PAD + i * 110
        icon = draw_icon(state, 64)
        img.paste(icon, (x + 20, PAD), icon)
        d.text((x + 52, PAD + 70), state.value, font=label_font, fill=TEXT, anchor="mt")
    menu_y = PAD * 2 + icons_h
    open_y = _draw_menu(d, menu, PAD, menu_y, menu_w, open_entry.label)
    if open_y is not None:
        _draw_menu(d, open_entry.submenu, PAD + menu_w - 4, open_y - 4, sub_w, None)
    return img


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "docs/tray-menu.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    render_tray_image().save(out, optimize=True)
    print(out)


if __name__ == "__main__":
    main()
