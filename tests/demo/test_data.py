"""The demo data generator: answers agree with the drawn objects (non-overlap, quadrant, counts, uniqueness)."""
import random

import numpy as np
import pytest

from luxjax.demo.data import (COLORS, QUESTION_TYPES, SHAPES, boxes_overlap, follow_up_questions, is_correct,
                              make_example, normalize_answer, render)


def check_answer(kind, question, answer, scenes):
    """The spec's reading of one question about `scenes`, from the question's own words."""
    shapes = scenes[0].shapes
    words = question.rstrip("?").split()
    if kind == "shape":
        assert question == "What shape is in the image?" and len(shapes) == 1 and answer == shapes[0].kind
    elif kind == "color":
        named = [s for s in shapes if s.kind == words[-1]]
        assert len(named) == 1 and answer == named[0].color
    elif kind == "count_shape":
        assert int(answer) == sum(s.kind + "s" == words[2] for s in shapes) and 1 <= int(answer) <= 5
    elif kind == "count_all":
        assert question == "How many shapes are there?"
        assert int(answer) == len(shapes) and 1 <= len(shapes) <= 5
    elif kind == "where":
        color, shape = words[-2], words[-1]
        hits = [s for s in shapes if (s.kind, s.color) == (shape, color)]
        assert len(hits) == 1
        s, sc = hits[0], scenes[0]
        vertical = "top" if s.cy < sc.height / 2 else "bottom"
        horizontal = "left" if s.cx < sc.width / 2 else "right"
        assert answer == f"{vertical} {horizontal}"
    else:
        assert len(scenes) == 2
        color, shape = words[4], words[5].rstrip(",")
        has = [any((s.kind, s.color) == (shape, color) for s in sc.shapes) for sc in scenes]
        assert has == ([True, False] if answer == "first" else [False, True])


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
        check_answer(kind, ex.question, ex.answer, ex.scenes)


@pytest.mark.parametrize("kind", QUESTION_TYPES)
def test_follow_up_questions_are_answered_by_the_spec_and_complete(kind):
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(40):
        ex = make_example(rng, kind)
        follow = follow_up_questions(ex)
        asked = [q for _, q, _ in follow]
        assert ex.question not in asked and len(set(asked)) == len(asked)
        for k, question, answer in follow:
            check_answer(k, question, answer, ex.scenes)
        if len(ex.scenes) == 2:  # every object in exactly one image is asked about
            a, b = ({(s.kind, s.color) for s in sc.shapes} for sc in ex.scenes)
            assert len(follow) + 1 == len(a ^ b) and all(k == "which" for k, _, _ in follow)
            continue
        shapes = ex.scenes[0].shapes
        kinds = [s.kind for s in shapes]
        expected = {"What shape is in the image?"} if len(shapes) == 1 else set()
        expected |= {f"What color is the {k}?" for k in SHAPES if kinds.count(k) == 1}
        expected |= {f"How many {k}s are there?" for k in set(kinds) if kinds.count(k) <= 5}
        expected |= {"How many shapes are there?"} if len(shapes) <= 5 else set()
        expected |= {f"Where is the {s.color} {s.kind}?" for s in shapes
                     if sum((t.kind, t.color) == (s.kind, s.color) for t in shapes) == 1}
        assert set(asked) | {ex.question} == expected


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
