"""Small figure helpers for demos (drawing itself is done by mmdet's/mmseg's own visualizers)."""
from typing import Optional, Sequence

from PIL import Image, ImageDraw


def tile_images(paths: Sequence[str], out_path: str, cols: int = 3, titles: Optional[Sequence[str]] = None,
                pad: int = 4) -> str:
    """Tile same-purpose images (e.g. the visualizer's per-image outputs) into one PNG grid."""
    if not paths:
        raise ValueError('tile_images needs at least one image')
    images = [Image.open(p).convert('RGB') for p in paths]
    w = max(im.width for im in images)
    h = max(im.height for im in images)
    title_h = 14 if titles else 0
    rows = (len(images) + cols - 1) // cols
    canvas = Image.new('RGB', (cols * (w + pad) + pad, rows * (h + title_h + pad) + pad), 'white')
    draw = ImageDraw.Draw(canvas)
    for i, im in enumerate(images):
        x = pad + (i % cols) * (w + pad)
        y = pad + (i // cols) * (h + title_h + pad)
        if titles:
            draw.text((x, y), str(titles[i]), fill=(0, 0, 0))
        canvas.paste(im, (x, y + title_h))
    canvas.save(out_path)
    return out_path
