"""The demo data generator: answers agree with the drawn objects (non-overlap, quadrant, counts, uniqueness)."""
import random

import numpy as np
import pytest

from luxjax.demo.data import (COLORS, QUESTION_TYPES, boxes_overlap, is_correct, make_example, normalize_answer,
                              render)


@pytest.mark.parametrize("kind", QUESTION_TYPES)
def test_answers_match_scenes(kind):
    rng = random.Random(hash(kind) % 1000)
    for _ in range(60):
        ex = make_example(rng, kind)
        for scene in ex.scenes:
            assert 96 <= scene.width <= 256 and 96 <= scene.height <= 256
            for i, a in enumerate(scene.shapes):
                x0, y0, x1, y1 = a.box()
                assert 16 <= a.size <= 64 and x0 >= 0 and y0 >= 0 and x1 <= scene.width and y1 <= scene.height
                assert not any(boxes_overlap(a, b, gap=0) for b in scene.shapes[i + 1:])
        shapes = ex.scenes[0].shapes
        words = ex.question.rstrip("?").split()
        if kind == "shape":
            assert len(shapes) == 1 and ex.answer == shapes[0].kind
        elif kind == "color":
            named = [s for s in shapes if s.kind == words[-1]]
            assert len(named) == 1 and ex.answer == named[0].color
        elif kind == "count_shape":
            assert int(ex.answer) == sum(s.kind + "s" == words[2] for s in shapes) and 1 <= int(ex.answer) <= 5
        elif kind == "count_all":
            assert int(ex.answer) == len(shapes) and 1 <= len(shapes) <= 5
        elif kind == "where":
            color, shape = words[-2], words[-1]
            hits = [s for s in shapes if (s.kind, s.color) == (shape, color)]
            assert len(hits) == 1
            s, sc = hits[0], ex.scenes[0]
            vertical = "top" if s.cy < sc.height / 2 else "bottom"
            horizontal = "left" if s.cx < sc.width / 2 else "right"
            assert ex.answer == f"{vertical} {horizontal}"
        else:
            color, shape = words[4], words[5].rstrip(",")
            has = [any((s.kind, s.color) == (shape, color) for s in sc.shapes) for sc in ex.scenes]
            assert has == ([True, False] if ex.answer == "first" else [False, True])


def test_render_draws_spec_colours_on_light_background():
    rng = random.Random(0)
    ex = make_example(rng, "shape")
    image = np.asarray(render(ex.scenes[0], rng))
    s = ex.scenes[0].shapes[0]
    assert image.shape == (ex.scenes[0].height, ex.scenes[0].width, 3)
    centre = image[int(s.cy), int(s.cx)].astype(int)
    assert np.abs(centre - np.array(COLORS[s.color])).max() < 40
    assert image[1, 1].min() >= 170  # a corner is background (objects keep a margin)


def test_grading():
    assert is_correct("Three.", "3") and is_correct("the circle", "circle") and is_correct("Top left!", "top left")
    assert not is_correct("2", "3")
    assert normalize_answer("An Orange") == "orange"
