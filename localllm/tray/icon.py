"""The tray icon, drawn with Pillow: a rounded square with a chat bubble, coloured by state.

idle: green; busy: amber with three dots in the bubble; error: red with a cross.
"""

from __future__ import annotations

from localllm.tray.model import TrayState

ICON_SIZE = 64
COLORS: dict[TrayState, tuple[int, int, int]] = {
    TrayState.IDLE: (46, 160, 67),
    TrayState.BUSY: (219, 148, 20),
    TrayState.ERROR: (200, 45, 45),
}


def draw_icon(state: TrayState, size: int = ICON_SIZE):
    """A ``size`` x ``size`` RGBA :class:`PIL.Image.Image` for ``state``."""
    from PIL import Image, ImageDraw

    scale = size / 64
    img = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)

    def box(x0: float, y0: float, x1: float, y1: float) -> tuple[int, int, int, int]:
        return (round(x0 * scale), round(y0 * scale), round(x1 * scale), round(y1 * scale))

    d.rounded_rectangle(box(2, 2, 62, 62), radius=round(12 * scale), fill=COLORS[state] + (255,))
    white = (255, 255, 255, 255)
    # the bubble and its tail
    d.rounded_rectangle(box(12, 14, 52, 42), radius=round(8 * scale), fill=white)
    d.polygon([(round(20 * scale), round(40 * scale)), (round(20 * scale), round(52 * scale)),
               (round(32 * scale), round(40 * scale))], fill=white)
    ink = COLORS[state] + (255,)
    if state is TrayState.BUSY:
        for cx in (22, 32, 42):
            d.ellipse(box(cx - 4, 24, cx + 4, 32), fill=ink)
    elif state is TrayState.ERROR:
        width = max(1, round(5 * scale))
        d.line([box(24, 20, 40, 36)[:2], box(24, 20, 40, 36)[2:]], fill=ink, width=width)
        d.line([box(40, 20, 24, 36)[:2], box(40, 20, 24, 36)[2:]], fill=ink, width=width)
    else:  # idle: a calm line of text
        width = max(1, round(4 * scale))
        d.line([box(20, 24, 44, 24)[:2], box(20, 24, 44, 24)[2:]], fill=ink, width=width)
        d.line([box(20, 32, 36, 32)[:2], box(20, 32, 36, 32)[2:]], fill=ink, width=width)
    return img
