"""Tests for the toy scene generator (normdense/data/toy_scenes.py)."""
import time
from collections import Counter

import numpy as np
import pytest

from normdense.data import toy_scenes as ts
from normdense.data.toy_scenes import (BACKGROUNDS, CLASSES, ShapeSpec, compose_scene,
                                       generate_classification_scene, generate_scene, mask_bbox,
                                       resolve_visibility, scene_rng, shape_mask)


@pytest.fixture(scope='module')
def scenes():
    return [generate_scene(scene_rng(0, 'train', i), size=160) for i in range(300)]


def _same(a, b):
    return (np.array_equal(a.image, b.image) and a.labels == b.labels
            and all(np.array_equal(x.mask, y.mask) and x.bbox == y.bbox
                    for x, y in zip(a.instances, b.instances)))


def test_classes_are_sorted_and_distinct():
    # sorted: mmpretrain's folder-scanning CustomDataset assigns ids in sorted folder order
    assert list(CLASSES) == sorted(CLASSES) and len(set(CLASSES)) == len(CLASSES) == 5


def test_same_seed_same_scene_different_seed_different():
    a = generate_scene(scene_rng(3, 'train', 7))
    b = generate_scene(scene_rng(3, 'train', 7))
    assert _same(a, b)
    for other in (scene_rng(4, 'train', 7), scene_rng(3, 'val', 7), scene_rng(3, 'train', 8)):
        assert not np.array_equal(a.image, generate_scene(other).image)
    # an int seed works too and is deterministic
    assert _same(generate_scene(11), generate_scene(11))


def test_image_and_instances_are_consistent(scenes):
    for s in scenes[:100]:
        assert s.image.dtype == np.uint8 and s.image.shape == (160, 160, 3)
        assert 1 <= len(s.instances) <= 6
        union = np.zeros((160, 160), int)
        for inst in s.instances:
            assert inst.mask.dtype == bool and inst.mask.shape == (160, 160)
            assert inst.area == int(inst.mask.sum()) >= 24
            assert inst.full_area >= inst.area and inst.visible_fraction >= 0.3
            x0, y0, x1, y1 = inst.bbox
            assert inst.bbox == mask_bbox(inst.mask)
            assert 0 <= x0 < x1 <= 160 and 0 <= y0 < y1 <= 160
            # the box is tight: every edge row/column of the box touches the mask
            box = inst.mask[y0:y1, x0:x1]
            assert box.sum() == inst.area
            assert box[0].any() and box[-1].any() and box[:, 0].any() and box[:, -1].any()
            assert inst.bbox_xywh == [x0, y0, x1 - x0, y1 - y0]
            union += inst.mask
        assert union.max() <= 1  # visible masks never overlap
        inst_map = s.instance_map()
        assert set(np.unique(inst_map)) <= set(range(len(s.instances) + 1))


def test_occlusion_happens_and_masks_show_only_the_visible_part(scenes):
    fractions = [inst.visible_fraction for s in scenes for inst in s.instances]
    assert min(fractions) >= 0.3
    assert sum(f < 0.99 for f in fractions) > 0.1 * len(fractions)  # occlusion is common
    # drawing order: a visible mask is the full shape minus everything drawn later
    spec_under = ShapeSpec(label=CLASSES.index('rectangle'), cx=60, cy=60, radius=40, angle=0.3,
                           aspect=0.8)
    spec_over = ShapeSpec(label=CLASSES.index('circle'), cx=95, cy=80, radius=30, angle=0.0)
    s = compose_scene(np.random.default_rng(0), [spec_under, spec_over], 160)
    full_under, full_over = shape_mask(spec_under, 160), shape_mask(spec_over, 160)
    assert (full_under & full_over).sum() > 200
    assert [i.label for i in s.instances] == [spec_under.label, spec_over.label]
    assert np.array_equal(s.instances[0].mask, full_under & ~full_over)
    assert np.array_equal(s.instances[1].mask, full_over)
    assert s.instances[0].full_area == full_under.sum()


def test_resolve_visibility_drops_topmost_failing_first():
    def cols(a, b):
        m = np.zeros((10, 20), bool)
        m[:, a:b] = True
        return m
    a, b, c = cols(0, 10), cols(2, 12), cols(4, 14)
    # b hides 80% of a and c hides 80% of b: both fail; dropping b (the topmost) rescues a
    kept, vis = resolve_visibility([a, b, c], min_area=5, min_visible=0.3)
    assert kept == [0, 2]
    assert np.array_equal(vis[0], cols(0, 4)) and np.array_equal(vis[1], c)
    # a tiny remnant is dropped by min_area even when the fraction rule would keep it
    kept, _ = resolve_visibility([cols(0, 2), cols(1, 5)], min_area=15, min_visible=0.0)
    assert kept == [1]
    # empty and fully hidden objects are dropped
    kept, _ = resolve_visibility([np.zeros((10, 20), bool), cols(0, 5), cols(0, 5)])
    assert kept == [2]


def test_dropped_objects_leave_no_pixels():
    """A dropped (tiny remnant) object is never painted: the image equals the scene without it."""
    big = ShapeSpec(label=CLASSES.index('rectangle'), cx=80, cy=80, radius=50, angle=0.0)
    small = ShapeSpec(label=CLASSES.index('circle'), cx=60, cy=80, radius=12, angle=0.0)
    with_hidden = compose_scene(np.random.default_rng(5), [small, big], 160)
    without = compose_scene(np.random.default_rng(5), [big], 160)
    assert with_hidden.labels == [big.label]
    assert np.array_equal(with_hidden.image, without.image)


def test_class_balance_and_speed(scenes):
    counts = Counter(l for s in scenes for l in s.labels)
    total = sum(counts.values())
    assert set(counts) == set(range(len(CLASSES)))
    for c in range(len(CLASSES)):
        assert 0.15 < counts[c] / total < 0.25, counts
    t0 = time.perf_counter()
    for i in range(300):
        generate_scene(scene_rng(1, 'speed', i), size=160)
    assert time.perf_counter() - t0 < 20.0  # ~1.5 s on one core; generous for a busy machine


def test_colour_does_not_identify_the_class(scenes):
    """Per-instance mean colours spread widely within every class and overlap across classes."""
    means = {c: [] for c in range(len(CLASSES))}
    for s in scenes[:150]:
        for inst in s.instances:
            means[inst.label].append(s.image[inst.mask].mean(axis=0))
    centroids = []
    for c, m in means.items():
        m = np.array(m)
        assert m.std(axis=0).mean() > 40, (CLASSES[c], m.std(axis=0))
        centroids.append(m.mean(axis=0))
    centroids = np.array(centroids)
    spread = np.linalg.norm(centroids[:, None] - centroids[None], axis=-1).max()
    assert spread < 60  # class colour centroids are close compared to the within-class spread


def test_backgrounds_and_sizes():
    for kind in BACKGROUNDS:
        s = generate_scene(np.random.default_rng(0), size=(96, 128), background=kind)
        assert s.background == kind and s.image.shape == (96, 128, 3)
        assert s.image.std() > 5  # textured, not flat
    kinds = Counter(generate_scene(scene_rng(0, 'bg', i), size=32).background for i in range(80))
    assert set(kinds) == set(BACKGROUNDS)
    with pytest.raises(ValueError):
        generate_scene(0, background='plaid')


def test_shapes_are_distinct():
    """Each class rasterises to its own shape: circle fills pi r^2, ring has a hole, etc."""
    r = 40.0
    area = {}
    for c, name in enumerate(CLASSES):
        m = shape_mask(ShapeSpec(label=c, cx=80, cy=80, radius=r, angle=0.2, aspect=1.0,
                                 inner=0.5), 160)
        area[name] = m.sum() / (np.pi * r * r)
        if name == 'ring':
            assert not m[80, 80]  # the hole
        else:
            assert m[80, 80]
    assert abs(area['circle'] - 1.0) < 0.03
    assert abs(area['ring'] - 0.75) < 0.05
    assert abs(area['rectangle'] - 4 / np.pi) < 0.05    # a square of half-side r
    assert abs(area['triangle'] - 3 * np.sqrt(3) / (4 * np.pi)) < 0.04  # equilateral
    assert abs(area['star'] - 5 * 0.5 * np.sin(np.pi / 5) / np.pi) < 0.04  # 10-gon, inner 0.5


def test_semantic_map_and_ignore_border(scenes):
    s = scenes[0]
    sem = s.semantic_map()
    assert sem.dtype == np.uint8 and set(np.unique(sem)) <= set(range(len(CLASSES) + 1))
    for inst in s.instances:
        assert (sem[inst.mask] == inst.label + 1).all()
    assert (sem[s.instance_map() == 0] == 0).all()
    bordered = s.semantic_map(ignore_border=2)
    ignored = bordered == 255
    assert ignored.any() and (bordered[~ignored] == sem[~ignored]).all()
    assert not ts.label_boundaries(np.zeros((8, 8), np.uint8), 2).any()


def test_min_area_scales_with_image_and_bad_arguments_raise():
    assert ts.default_min_area(160) == 24 and ts.default_min_area((320, 320)) == 96
    assert ts.default_min_area(32) == 4
    s = generate_scene(scene_rng(0, 'big', 0), size=320)
    assert all(inst.area >= 96 for inst in s.instances)
    assert generate_scene(0, num_objects=(0, 0)).instances == []
    with pytest.raises(ValueError):
        generate_scene(0, num_objects=(3, 2))


def test_classification_scene():
    for i in range(25):
        label = i % len(CLASSES)
        s = generate_classification_scene(scene_rng(0, 'cls', i), label)
        dom = s.instances[-1]
        assert dom.label == label and dom.visible_fraction == 1.0
        assert all(dom.area > 3 * other.area for other in s.instances[:-1])
        assert len(s.instances) <= 3
