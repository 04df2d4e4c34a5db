"""The evaluation's second drawing routine draws what the scene says: each object's centre pixel has the spec colour
(when no noise was added), the canvas corners stay light background, and shapes differ where they should."""
from __future__ import annotations

import random

import numpy as np

from luxjax.demo.data import COLORS, Scene, Shape, make_example
from luxjax.demo.eval import draw_plain


class NoNoise(random.Random):
    def random(self):  # draw_plain adds noise when random() < 0.5
        return 0.99


def test_centres_have_the_spec_colours():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for kind in ("count_shape", "where", "color", "count_all") * 5:
        ex = make_example(rng, kind)
        for scene in ex.scenes:
            pixels = np.asarray(draw_plain(scene, NoNoise(seed)))
            assert pixels.shape == (scene.height, scene.width, 3)
            assert (pixels[0, 0] >= 200).all() and (pixels[-1, -1] >= 200).all(), seed
            for s in scene.shapes:
                centre = pixels[int(s.cy), int(s.cx)]
                assert tuple(centre) == COLORS[s.color], (seed, s)


def test_triangle_square_circle_differ_at_the_corners_of_their_box():
    scene = Scene(200, 100, (Shape("square", "red", 50.0, 50.0, 40), Shape("circle", "blue", 100.0, 50.0, 40),
                             Shape("triangle", "green", 150.0, 50.0, 40)))
    pixels = np.asarray(draw_plain(scene, NoNoise(0))).astype(int)
    near_top_left = {s.kind: pixels[int(s.cy - 18), int(s.cx - 18)] for s in scene.shapes}
    assert tuple(near_top_left["square"]) == COLORS["red"]
    assert (near_top_left["circle"] >= 200).all() and (near_top_left["triangle"] >= 200).all()
    bottom_left = {s.kind: pixels[int(s.cy + 18), int(s.cx - 18)] for s in scene.shapes}
    assert tuple(bottom_left["triangle"]) == COLORS["green"] and (bottom_left["circle"] >= 200).all()
