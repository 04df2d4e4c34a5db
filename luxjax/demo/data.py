"""Procedural shape-question data for the packaged demo model, fixed by the spec: scenes of circles, squares and
triangles in seven colours on light canvases, six question types, and the grading rule.

Rendering is deliberately varied (positions, sizes, backgrounds, noise, anti-aliasing on/off) so the model does
not learn one renderer's quirks: an outside check draws its own images from the same spec.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLORS = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 220), "yellow": (240, 210, 30),
    "purple": (140, 50, 170), "orange": (245, 140, 20), "black": (20, 20, 20),
}  # fmt: skip
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTION_TYPES = ("shape", "color", "count_shape", "count_all", "where", "which")
NUMBER_WORDS = {"zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
                "seven": "7", "eight": "8", "nine": "9", "ten": "10"}


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    cx: float  # centre, pixels
    cy: float
    size: int  # side of the bounding box

    def box(self) -> tuple[float, float, float, float]:
        h = self.size / 2
        return self.cx - h, self.cy - h, self.cx + h, self.cy + h

    def quadrant(self, width: int, height: int) -> str:
        return f"{'top' if self.cy < height / 2 else 'bottom'} {'left' if self.cx < width / 2 else 'right'}"


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Example:
    kind: str  # one of QUESTION_TYPES
    question: str
    answer: str
    scenes: tuple[Scene, ...]


def boxes_overlap(a: Shape, b: Shape, gap: float = 2.0) -> bool:
    ax0, ay0, ax1, ay1 = a.box()
    bx0, by0, bx1, by1 = b.box()
    return not (ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0)


def place(rng: random.Random, specs: list[tuple[str, str]]) -> Scene:
    """Random canvas and non-overlapping placement of (kind, colour) objects; retries with smaller objects."""
    width, height = rng.randint(96, 256), rng.randint(96, 256)
    for attempt in range(200):
        top = max(16, 64 - attempt // 4)
        shapes: list[Shape] = []
        for kind, color in specs:
            for _ in range(50):
                size = rng.randint(16, min(top, width - 4, height - 4))
                h = size / 2
                cx, cy = rng.uniform(h + 1, width - h - 1), rng.uniform(h + 1, height - h - 1)
                if abs(cx - width / 2) < 2 or abs(cy - height / 2) < 2:
                    continue  # keep the quadrant unambiguous
                cand = Shape(kind, color, round(cx, 1), round(cy, 1), size)
                if not any(boxes_overlap(cand, s) for s in shapes):
                    shapes.append(cand)
                    break
            else:
                break
        if len(shapes) == len(specs):
            return Scene(width, height, tuple(shapes))
    raise RuntimeError(f"could not place {specs}")


def render(scene: Scene, rng: random.Random) -> Image.Image:
    """RGB image: light background, optional anti-aliasing (supersampling), colour jitter and light noise."""
    bg = (255, 255, 255) if rng.random() < 0.4 else tuple(rng.randint(200, 255) for _ in range(3))
    ss = rng.choice((1, 1, 2, 4))  # 1 = aliased edges
    img = Image.new("RGB", (scene.width * ss, scene.height * ss), bg)
    draw = ImageDraw.Draw(img)
    for s in scene.shapes:
        color = tuple(int(np.clip(c + rng.randint(-6, 6), 0, 255)) for c in COLORS[s.color])
        x0, y0, x1, y1 = (v * ss for v in s.box())
        if s.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=color)
        elif s.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            top = y0 + rng.uniform(0, 0.1) * (y1 - y0)
            draw.polygon([((x0 + x1) / 2, top), (x1, y1), (x0, y1)], fill=color)
    if ss > 1:
        img = img.resize((scene.width, scene.height), Image.Resampling.BOX)
    if rng.random() < 0.5:
        noise = np.random.default_rng(rng.getrandbits(32)).normal(0, rng.uniform(1, 8), (scene.height, scene.width, 3))
        img = Image.fromarray(np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8))
    return img


def _pick_specs(rng: random.Random, n: int, avoid: set | None = None) -> list[tuple[str, str]]:
    out = []
    while len(out) < n:
        spec = (rng.choice(SHAPES), rng.choice(list(COLORS)))
        if not avoid or spec not in avoid:
            out.append(spec)
    return out


def make_example(rng: random.Random, kind: str | None = None) -> Example:
    kind = kind or rng.choice(QUESTION_TYPES)
    colors = list(COLORS)
    if kind == "shape":
        shape = rng.choice(SHAPES)
        return Example(kind, "What shape is in the image?", shape, (place(rng, [(shape, rng.choice(colors))]),))
    if kind == "color":
        shape, color = rng.choice(SHAPES), rng.choice(colors)
        others = [(rng.choice([s for s in SHAPES if s != shape]), rng.choice(colors)) for _ in range(rng.randint(0, 3))]
        specs = [(shape, color)] + others
        rng.shuffle(specs)
        return Example(kind, f"What color is the {shape}?", color, (place(rng, specs),))
    if kind == "count_shape":
        shape, n = rng.choice(SHAPES), rng.randint(1, 5)
        specs = [(shape, rng.choice(colors)) for _ in range(n)]
        specs += [(rng.choice([s for s in SHAPES if s != shape]), rng.choice(colors))
                  for _ in range(rng.randint(0, 6 - n))]
        rng.shuffle(specs)
        return Example(kind, f"How many {shape}s are there?", str(n), (place(rng, specs),))
    if kind == "count_all":
        n = rng.randint(1, 5)
        return Example(kind, "How many shapes are there?", str(n), (place(rng, _pick_specs(rng, n)),))
    if kind == "where":
        target = (rng.choice(SHAPES), rng.choice(colors))
        specs = [target] + _pick_specs(rng, rng.randint(0, 3), {target})
        rng.shuffle(specs)
        scene = place(rng, specs)
        obj = next(s for s in scene.shapes if (s.kind, s.color) == target)
        where = obj.quadrant(scene.width, scene.height)
        return Example(kind, f"Where is the {target[1]} {target[0]}?", where, (scene,))
    if kind == "which":
        target = (rng.choice(SHAPES), rng.choice(colors))
        near = [(target[0], c) for c in colors if c != target[1]] + [(s, target[1]) for s in SHAPES if s != target[0]]
        with_t = [target] + _pick_specs(rng, rng.randint(0, 2), {target})
        without = [rng.choice(near)] + _pick_specs(rng, rng.randint(0, 2), {target})
        rng.shuffle(with_t)
        rng.shuffle(without)
        first = rng.random() < 0.5
        scenes = (place(rng, with_t), place(rng, without)) if first else (place(rng, without), place(rng, with_t))
        question = f"Which image has a {target[1]} {target[0]}, the first or the second?"
        return Example(kind, question, "first" if first else "second", scenes)
    raise ValueError(f"unknown question type {kind!r}")


def scene_questions(scene: Scene) -> list[tuple[str, str, str]]:
    """Every (kind, question, answer) of the single-image types that the spec allows for this scene."""
    kinds = [s.kind for s in scene.shapes]
    pairs = [(s.kind, s.color) for s in scene.shapes]
    out = []
    if len(scene.shapes) == 1:
        out.append(("shape", "What shape is in the image?", kinds[0]))
    for shape in SHAPES:
        count = kinds.count(shape)
        if count == 1:
            out.append(("color", f"What color is the {shape}?", scene.shapes[kinds.index(shape)].color))
        if 1 <= count <= 5:
            out.append(("count_shape", f"How many {shape}s are there?", str(count)))
    if 1 <= len(scene.shapes) <= 5:
        out.append(("count_all", "How many shapes are there?", str(len(scene.shapes))))
    for obj in scene.shapes:
        if pairs.count((obj.kind, obj.color)) == 1:
            where = obj.quadrant(scene.width, scene.height)
            out.append(("where", f"Where is the {obj.color} {obj.kind}?", where))
    return out


def pair_questions(first: Scene, second: Scene) -> list[tuple[str, str, str]]:
    """Every "which" question the spec allows for two images: objects present in exactly one of them."""
    a = {(s.kind, s.color) for s in first.shapes}
    b = {(s.kind, s.color) for s in second.shapes}
    question = "Which image has a {} {}, the first or the second?"
    return [("which", question.format(color, shape), "first" if (shape, color) in a else "second")
            for shape, color in sorted(a ^ b)]


def follow_up_questions(ex: Example) -> list[tuple[str, str, str]]:
    """Other questions with exact answers about the same image(s), excluding the example's own question. Training
    asks a few of them as later turns of the conversation: more supervision per rendered image."""
    qs = scene_questions(ex.scenes[0]) if len(ex.scenes) == 1 else pair_questions(*ex.scenes)
    return [q for q in qs if q[1] != ex.question]


def examples(seed: int, n: int, kinds=QUESTION_TYPES):
    """`n` examples with question types cycling through `kinds`, then their images: [(Example, [PIL images])]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ex = make_example(rng, kinds[i % len(kinds)])
        out.append((ex, [render(s, rng) for s in ex.scenes]))
    return out


def normalize_answer(text: str) -> str:
    """Grading: lower-case, strip punctuation and articles, number words equal digits."""
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return " ".join(NUMBER_WORDS.get(w, w) for w in words if w not in ("a", "an", "the"))


def is_correct(prediction: str, answer: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(answer)
