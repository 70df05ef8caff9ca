"""Deterministic toy scenes: shapes on textured backgrounds, with exact per-instance masks.

Every toy dataset writer (COCO, VOC, ImageNet layout) draws its images from here, so detection,
segmentation and classification demos all see the same kind of scene.

A scene is built in three steps:

1. *geometry*: each object (class, centre, size, rotation, shape parameters) is rasterised to a
   full binary mask, clipped to the image;
2. *visibility*: objects are stacked in drawing order (later ones occlude earlier ones); an object
   whose visible part is smaller than ``min_area`` pixels or than ``min_visible`` of its own
   unoccluded area is dropped *before* anything is painted, so a dropped object leaves no pixels
   behind and every painted pixel belongs to exactly one annotated instance or to the background;
3. *painting*: a textured background (smooth noise, gradient, stripes or checkerboard) is drawn and
   the kept objects are painted over it in order, each with its own colour, shading and noise.

Colours are drawn independently of the class (and picked to contrast with what lies beneath), so
only shape identifies a class. Everything is seeded: :func:`scene_rng` derives one independent
generator per ``(seed, split, index)``, so any image can be regenerated on its own.

Pure numpy + Pillow's ``ImageDraw`` (for polygon rasterisation); a 160x160 scene takes ~5 ms.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image, ImageDraw

#: Toy class names; the class id of an instance is its index here. Kept in alphabetical order so
#: that datasets deriving classes from sorted folder names (mmpretrain's ``CustomDataset`` without
#: an ``ann_file``) give the same ids as the annotation files.
CLASSES: Tuple[str, ...] = ('circle', 'rectangle', 'ring', 'star', 'triangle')

#: Fixed display colours per class (only for visualisation; scene colours are random).
CLASS_COLORS: Tuple[Tuple[int, int, int], ...] = (
    (230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180))

BACKGROUNDS: Tuple[str, ...] = ('noise', 'gradient', 'stripes', 'checker')

SizeLike = Union[int, Tuple[int, int]]


@dataclass(frozen=True)
class ShapeSpec:
    """Geometry of one object before occlusion: what :func:`shape_mask` rasterises."""
    label: int
    cx: float
    cy: float
    radius: float           # outer radius in pixels
    angle: float            # rotation in radians
    aspect: float = 1.0     # minor/major ratio (rectangle, ring)
    inner: float = 0.5      # inner radius ratio (ring, star)
    jitter: Tuple[float, ...] = ()  # per-vertex angle/radius jitter (triangle)


@dataclass
class ToyInstance:
    """One visible object. ``mask`` holds only its visible (unoccluded, in-image) pixels."""
    label: int
    mask: np.ndarray                    # (H, W) bool
    bbox: Tuple[int, int, int, int]     # x0, y0, x1, y1 in pixel-edge coordinates (x1, y1 exclusive)
    area: int                           # visible pixels
    full_area: int                      # pixels of the unoccluded shape inside the image

    @property
    def name(self) -> str:
        return CLASSES[self.label]

    @property
    def bbox_xywh(self) -> List[int]:
        x0, y0, x1, y1 = self.bbox
        return [x0, y0, x1 - x0, y1 - y0]

    @property
    def visible_fraction(self) -> float:
        return self.area / max(self.full_area, 1)


@dataclass
class ToyScene:
    """An RGB uint8 image with its instances in drawing order (later ones are on top)."""
    image: np.ndarray                               # (H, W, 3) uint8
    instances: List[ToyInstance] = field(default_factory=list)
    background: str = ''

    @property
    def labels(self) -> List[int]:
        return [inst.label for inst in self.instances]

    def instance_map(self) -> np.ndarray:
        """(H, W) int32: 0 for background, ``i + 1`` for pixels of ``instances[i]``."""
        out = np.zeros(self.image.shape[:2], np.int32)
        for i, inst in enumerate(self.instances):
            out[inst.mask] = i + 1
        return out

    def semantic_map(self, offset: int = 1, ignore_border: int = 0,
                     ignore_index: int = 255) -> np.ndarray:
        """(H, W) uint8 label map: 0 = background, ``label + offset`` for object pixels.

        ``ignore_border > 0`` marks pixels within that many pixels of a label change with
        ``ignore_index``, like the 255 outlines of PASCAL VOC's ``SegmentationClass``.
        """
        sem = np.zeros(self.image.shape[:2], np.uint8)
        for inst in self.instances:
            sem[inst.mask] = inst.label + offset
        if ignore_border > 0:
            sem = np.where(label_boundaries(sem, ignore_border), np.uint8(ignore_index), sem)
        return sem


# ----------------------------------------------------------------------------------------------
# seeding


def split_code(split: str) -> int:
    """A stable integer for a split name (crc32, independent of Python's hash seed)."""
    return zlib.crc32(split.encode('utf-8'))


def scene_rng(seed: int, split: str = 'train', index: int = 0) -> np.random.Generator:
    """The generator for image ``index`` of ``split``: independent of every other image."""
    return np.random.default_rng([int(seed), split_code(split), int(index)])


def _hw(size: SizeLike) -> Tuple[int, int]:
    if isinstance(size, (int, np.integer)):
        return int(size), int(size)
    h, w = size
    return int(h), int(w)


# ----------------------------------------------------------------------------------------------
# geometry


def _ellipse(cx, cy, a, b, angle, n=64):
    t = np.linspace(0.0, 2.0 * math.pi, n, endpoint=False)
    x, y = a * np.cos(t), b * np.sin(t)
    c, s = math.cos(angle), math.sin(angle)
    return np.stack([cx + c * x - s * y, cy + s * x + c * y], axis=1)


def shape_polygons(spec: ShapeSpec) -> List[Tuple[np.ndarray, int]]:
    """(polygon (N, 2) xy array, fill value) pairs; drawn in order they make the shape's mask."""
    r, ang = spec.radius, spec.angle
    name = CLASSES[spec.label]
    if name == 'circle':
        return [(_ellipse(spec.cx, spec.cy, r, r, 0.0), 1)]
    if name == 'ring':
        outer = _ellipse(spec.cx, spec.cy, r, r * spec.aspect, ang)
        inner = _ellipse(spec.cx, spec.cy, r * spec.inner, r * spec.aspect * spec.inner, ang)
        return [(outer, 1), (inner, 0)]
    if name == 'rectangle':
        hx, hy = r, r * spec.aspect
        local = np.array([[-hx, -hy], [hx, -hy], [hx, hy], [-hx, hy]])
    elif name == 'triangle':
        jit = spec.jitter or (0.0,) * 6
        t = np.array([-math.pi / 2 + k * 2 * math.pi / 3 + jit[k] for k in range(3)])
        rad = r * (1.0 + np.array(jit[3:6]))
        local = np.stack([rad * np.cos(t), rad * np.sin(t)], axis=1)
    elif name == 'star':
        k = np.arange(10)
        rad = np.where(k % 2 == 0, r, r * spec.inner)
        t = -math.pi / 2 + k * math.pi / 5
        local = np.stack([rad * np.cos(t), rad * np.sin(t)], axis=1)
    else:  # pragma: no cover - CLASSES and this function are edited together
        raise ValueError(f'unknown toy class {name!r}')
    c, s = math.cos(ang), math.sin(ang)
    rot = np.array([[c, -s], [s, c]])
    return [(local @ rot.T + np.array([spec.cx, spec.cy]), 1)]


def shape_mask(spec: ShapeSpec, size: SizeLike) -> np.ndarray:
    """The unoccluded (H, W) bool mask of ``spec``, clipped to the image."""
    h, w = _hw(size)
    img = Image.new('L', (w, h), 0)
    draw = ImageDraw.Draw(img)
    for poly, fill in shape_polygons(spec):
        draw.polygon([(float(x), float(y)) for x, y in poly], fill=fill)
    return np.asarray(img, dtype=bool)


def sample_shape(rng: np.random.Generator, label: int, size: SizeLike,
                 radius_range: Tuple[float, float] = (0.07, 0.28),
                 center: Optional[Tuple[float, float]] = None,
                 center_margin: float = 0.05) -> ShapeSpec:
    """Random geometry for one object of class ``label``.

    ``radius_range`` is a fraction of the shorter image side (sampled log-uniformly); the centre is
    uniform over the image minus ``center_margin`` on each side (objects may be cut by the border)
    unless ``center`` (pixels) is given.
    """
    h, w = _hw(size)
    lo, hi = radius_range
    radius = min(h, w) * math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if center is None:
        cx = rng.uniform(center_margin, 1 - center_margin) * w
        cy = rng.uniform(center_margin, 1 - center_margin) * h
    else:
        cx, cy = center
    angle = rng.uniform(0.0, 2 * math.pi)
    name = CLASSES[label]
    aspect, inner, jitter = 1.0, 0.5, ()
    if name == 'rectangle':
        aspect = rng.uniform(0.45, 1.0)
        radius *= 0.85  # half-width; keeps the area comparable with the other classes
    elif name == 'ring':
        aspect = rng.uniform(0.7, 1.0)
        inner = rng.uniform(0.45, 0.65)
    elif name == 'star':
        inner = rng.uniform(0.38, 0.5)
        radius *= 1.15  # stars have little area for their radius
    elif name == 'triangle':
        jitter = tuple(rng.uniform(-0.25, 0.25, 3)) + tuple(rng.uniform(-0.12, 0.1, 3))
        radius *= 1.1
    return ShapeSpec(label=int(label), cx=float(cx), cy=float(cy), radius=float(radius),
                     angle=float(angle), aspect=float(aspect), inner=float(inner),
                     jitter=tuple(float(j) for j in jitter))


def mask_bbox(mask: np.ndarray) -> Tuple[int, int, int, int]:
    """Tight box (x0, y0, x1, y1) of a non-empty mask in pixel-edge coordinates (x1, y1 exclusive)."""
    ys = np.flatnonzero(mask.any(axis=1))
    xs = np.flatnonzero(mask.any(axis=0))
    if len(xs) == 0:
        raise ValueError('empty mask has no bounding box')
    return int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1


def resolve_visibility(full_masks: Sequence[np.ndarray], min_area: int = 24,
                       min_visible: float = 0.3) -> Tuple[List[int], List[np.ndarray]]:
    """Which stacked objects stay, and their visible masks.

    ``full_masks`` are in drawing order (later on top). An object is dropped if its visible area is
    below ``min_area`` pixels or below ``min_visible`` times its unoccluded area. Dropping an object
    uncovers the ones beneath it, so the topmost failing object is dropped first and visibility is
    recomputed until every remaining object passes. Returns (kept indices, their visible masks).
    """
    n = len(full_masks)
    keep = [bool(m.any()) for m in full_masks]
    full_area = [int(m.sum()) for m in full_masks]
    while True:
        visible: List[Optional[np.ndarray]] = [None] * n
        covered = np.zeros(full_masks[0].shape, bool) if n else None
        for i in reversed(range(n)):  # top to bottom
            if keep[i]:
                visible[i] = full_masks[i] & ~covered
                covered |= full_masks[i]
        failing = [i for i in range(n) if keep[i] and (
            int(visible[i].sum()) < max(min_area, 1)
            or int(visible[i].sum()) < min_visible * full_area[i])]
        if not failing:
            break
        keep[max(failing)] = False
    kept = [i for i in range(n) if keep[i]]
    return kept, [visible[i] for i in kept]


# ----------------------------------------------------------------------------------------------
# appearance


def _random_color(rng: np.random.Generator, sat=(0.25, 1.0), val=(0.25, 1.0)) -> np.ndarray:
    """A random RGB colour in [0, 255] from HSV with the given saturation/value ranges."""
    hue = rng.uniform(0, 6)
    s, v = rng.uniform(*sat), rng.uniform(*val)
    i, f = int(hue) % 6, hue - int(hue)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return np.array(rgb, np.float32) * 255.0


def _coords(h, w):
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    return x, y


def render_background(rng: np.random.Generator, size: SizeLike,
                      kind: Optional[str] = None) -> Tuple[np.ndarray, str]:
    """A float32 (H, W, 3) textured background in [0, 255] and its kind."""
    h, w = _hw(size)
    kind = kind or BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    c0 = _random_color(rng, sat=(0.0, 0.7))
    c1 = _random_color(rng, sat=(0.0, 0.7))
    x, y = _coords(h, w)
    theta = rng.uniform(0, math.pi)
    proj = x * math.cos(theta) + y * math.sin(theta)
    if kind == 'gradient':
        t = (proj - proj.min()) / max(float(np.ptp(proj)), 1e-6)
    elif kind == 'stripes':
        period = rng.uniform(6, 24)
        t = 0.5 + 0.5 * np.sin(2 * math.pi * proj / period)
        if rng.random() < 0.5:
            t = (t > 0.5).astype(np.float32)
        c1 = c0 + (c1 - c0) * rng.uniform(0.3, 0.7)  # keep stripes from dominating the objects
    elif kind == 'checker':
        cell = rng.uniform(8, 24)
        u = -x * math.sin(theta) + y * math.cos(theta)
        t = ((np.floor(proj / cell) + np.floor(u / cell)) % 2).astype(np.float32)
        c1 = c0 + (c1 - c0) * rng.uniform(0.3, 0.6)
    elif kind == 'noise':
        cells = int(rng.integers(3, 10))
        low = rng.uniform(0, 255, (cells, cells, 3)).astype(np.uint8)
        smooth = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), np.float32)
        base = c0 + (c1 - c0) * 0.5
        return np.clip(base + (smooth - 127.5) * rng.uniform(0.25, 0.6), 0, 255), kind
    else:
        raise ValueError(f'unknown background {kind!r}; choose from {BACKGROUNDS}')
    return c0 + (c1 - c0) * t[..., None], kind


def _pick_color(rng: np.random.Generator, under: np.ndarray, tries: int = 8,
                min_dist: float = 90.0) -> np.ndarray:
    """An object colour that stands out from ``under`` (the (N, 3) pixels it will cover)."""
    ref = under.mean(axis=0)
    best, best_d = None, -1.0
    for _ in range(tries):
        c = _random_color(rng)
        d = float(np.linalg.norm(c - ref))
        if d >= min_dist:
            return c
        if d > best_d:
            best, best_d = c, d
    return best


def _paint(canvas: np.ndarray, mask: np.ndarray, rng: np.random.Generator, spec: ShapeSpec):
    """Paint one object (in place): random colour with linear shading and a little texture."""
    color = _pick_color(rng, canvas[mask])
    ys, xs = np.nonzero(mask)
    phi = rng.uniform(0, 2 * math.pi)
    proj = ((xs - spec.cx) * math.cos(phi) + (ys - spec.cy) * math.sin(phi)) / max(spec.radius, 1.0)
    shade = 1.0 + rng.uniform(0.0, 0.25) * proj
    pix = color[None, :] * shade[:, None]
    if rng.random() < 0.3:  # faint stripes inside the object
        period = rng.uniform(3, 8)
        pix = pix * (1.0 + 0.12 * np.sin(2 * math.pi * (xs * math.sin(phi) - ys * math.cos(phi))
                                         / period))[:, None]
    canvas[ys, xs] = np.clip(pix, 0, 255)


def label_boundaries(label_map: np.ndarray, width: int = 1) -> np.ndarray:
    """(H, W) bool: pixels within ``width`` (Chebyshev) of a pixel with another label."""
    h, w = label_map.shape
    pad = np.pad(label_map, width, mode='edge')
    out = np.zeros((h, w), bool)
    for dy in range(-width, width + 1):
        for dx in range(-width, width + 1):
            if dy or dx:
                out |= pad[width + dy:width + dy + h, width + dx:width + dx + w] != label_map
    return out


# ----------------------------------------------------------------------------------------------
# scenes


def default_min_area(size: SizeLike) -> int:
    """24 pixels at 160x160, scaled with the image area (at least 4)."""
    h, w = _hw(size)
    return max(4, int(round(24 * h * w / 160 ** 2)))


def compose_scene(rng: np.random.Generator, specs: Sequence[ShapeSpec], size: SizeLike,
                  background: Optional[str] = None, min_area: Optional[int] = None,
                  min_visible: float = 0.3, noise_std: Optional[float] = None) -> ToyScene:
    """Render objects ``specs`` (drawing order, later on top) over a random background."""
    h, w = _hw(size)
    if min_area is None:
        min_area = default_min_area((h, w))
    canvas, kind = render_background(rng, (h, w), background)
    full = [shape_mask(s, (h, w)) for s in specs]
    kept, visible = resolve_visibility(full, min_area=min_area, min_visible=min_visible) \
        if specs else ([], [])
    for i in kept:  # paint full shapes in order: later ones cover earlier ones exactly
        _paint(canvas, full[i], rng, specs[i])
    sigma = rng.uniform(2.0, 8.0) if noise_std is None else noise_std
    if sigma > 0:
        canvas = canvas + rng.normal(0.0, sigma, canvas.shape).astype(np.float32)
    image = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    instances = [ToyInstance(label=specs[i].label, mask=vis, bbox=mask_bbox(vis), area=int(vis.sum()),
                             full_area=int(full[i].sum())) for i, vis in zip(kept, visible)]
    return ToyScene(image=image, instances=instances, background=kind)


def _class_sequence(rng: np.random.Generator, n: int, num_classes: int) -> List[int]:
    """``n`` class ids: concatenated random permutations, so an image repeats a class only after
    using all of them (tighter class balance than independent draws)."""
    out: List[int] = []
    while len(out) < n:
        out.extend(int(c) for c in rng.permutation(num_classes))
    return out[:n]


def generate_scene(rng: Union[np.random.Generator, int], size: SizeLike = 160,
                   num_objects: Tuple[int, int] = (2, 6),
                   radius_range: Tuple[float, float] = (0.07, 0.28),
                   min_area: Optional[int] = None, min_visible: float = 0.3,
                   background: Optional[str] = None) -> ToyScene:
    """A detection/segmentation scene: ``num_objects`` (inclusive range) random objects, some of
    which may be dropped by the visibility rule (see :func:`resolve_visibility`; ``min_area``
    defaults to :func:`default_min_area`)."""
    if not 0 <= num_objects[0] <= num_objects[1]:
        raise ValueError(f'num_objects must be (min, max) with 0 <= min <= max, got {num_objects}')
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    if min_area is None:
        min_area = default_min_area(size)
    n = int(rng.integers(num_objects[0], num_objects[1] + 1))
    labels = _class_sequence(rng, n, len(CLASSES))
    specs = [sample_shape(rng, c, size, radius_range) for c in labels]
    return compose_scene(rng, specs, size, background=background, min_area=min_area,
                         min_visible=min_visible)


def generate_classification_scene(rng: Union[np.random.Generator, int], label: int,
                                  size: SizeLike = 160, max_distractors: int = 2,
                                  background: Optional[str] = None) -> ToyScene:
    """One dominant, unoccluded object of class ``label`` near the centre (drawn last), over up to
    ``max_distractors`` small objects of any class. ``instances[-1]`` is the dominant object."""
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    h, w = _hw(size)
    specs = []
    for _ in range(int(rng.integers(0, max_distractors + 1))):
        specs.append(sample_shape(rng, int(rng.integers(len(CLASSES))), (h, w), (0.06, 0.11)))
    center = (w * rng.uniform(0.4, 0.6), h * rng.uniform(0.4, 0.6))
    specs.append(sample_shape(rng, label, (h, w), (0.24, 0.36), center=center))
    scene = compose_scene(rng, specs, (h, w), background=background)
    if not scene.instances or scene.instances[-1].label != label:  # on top and large: cannot happen
        raise RuntimeError('the dominant object of a classification scene was dropped')
    return scene
