"""A synthetic visual question-answering task family whose answers depend on what is in the images.

Everything is drawn locally with PIL from a seed (nothing is downloaded), small by default
(112x112 pixels: 4x4 = 16 image tokens after Qwen2.5-VL's 2x2 merge of 14-pixel patches) so a
tiny model can learn it on a CPU, and legible at that size: big solid shapes on a 3x3 grid.

Two image families, both described by a hashable :class:`ImageSpec` and drawn by :func:`render`:

- ``gui`` screenshots: 1-4 :class:`Element` s, one per cell of a 3x3 grid (``CELLS``), each with a
  ``kind`` ('button' = filled rounded rectangle, 'field' = outlined rectangle, 'icon' = filled
  circle), a ``colour`` from ``COLOURS`` and a short ``label`` from ``LABELS`` drawn on it. Within a
  screenshot, cells, colours and labels are all distinct.
- ``docs`` pages: a ``title`` from ``TITLES`` above a rule and 2-4 lines of two words from ``WORDS``.

Question types (``QUESTIONS``; answers come from the closed sets in ``ANSWER_SETS``):

==============  ====  ======================================================================
name            min   single image / several (the ordinal names one image among them)
==============  ====  ======================================================================
``colour``      1     "What colour is the button in the top left?" / "... of the second screenshot?"
``where``       1     "Where is the Save button?" / "... in the third screenshot?"
``label``       1     "What is the label of the red button?" / "... in the second screenshot?"
``which``       2     "Which screenshot shows the Save button?" (first / second / third / fourth)
``title``       1     "What is the title of this page?" / "What is the title of the second page?"
``word``        1     "What is the first word of the second line?" / "... of the first page?"
``before``      2     "What is the title of the page shown before this one?" (this one = the last image)
``which_page``  2     "Which page has the title Budget?"
==============  ====  ======================================================================

In examples with several images the generator plants distractors (the same kind at the same cell
in another screenshot, the same label elsewhere, the same colour and kind with another label), so
only the named image gives the answer; for ``which`` the label is in exactly one image. With
``kind="mixed"`` screenshots and pages are mixed and the noun is "image".

Data API: :func:`make_example` (one :class:`Example` from a seed), :func:`examples` (train and test
draw from disjoint seed streams), :func:`messages` (samcache's chat format, the answer as the
assistant's reply; ``dense=True`` first describes every image, see :func:`describe`),
:func:`parse_answer` / :func:`is_correct` for scoring replies.

Multi-turn traces (:func:`trace`) move the same images between positions as the benchmark's
scenarios do (:mod:`samcache.bench.workloads`): ``gui`` (a sliding window of screenshots), ``reorder``
(pages shown in a new order every turn) and ``subagent`` (a planner, sub-agents with their own
system prompts over the images in a new order, then the chosen branch continued with its history).
Every turn is the whole request with pixel arrays and a known answer.

Why this module is long: the task family is one closed vocabulary (cells, colours, labels, titles,
words), its renderer, its question types and their scorers: a question, the image it asks about and
the check of its answer must agree, so they stay together.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from samcache._checks import check_int, check_seed
from samcache.engine.prompt import user_message

#: Named colours, far apart in RGB (each pair differs by more than 100 in Euclidean distance).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 25, 25), "green": (30, 160, 60), "blue": (40, 80, 230), "yellow": (250, 230, 40),
    "purple": (140, 50, 190), "orange": (255, 130, 0), "black": (15, 15, 15), "white": (255, 255, 255),
}
KINDS = ("button", "field", "icon")
#: The 3x3 grid, row by row.
CELLS = ("top left", "top middle", "top right", "middle left", "center", "middle right",
         "bottom left", "bottom middle", "bottom right")
LABELS = ("Save", "Open", "Send", "Close", "Print", "Next", "Back", "Edit", "Copy", "Help", "Exit", "Find")
TITLES = ("Report", "Invoice", "Budget", "Agenda", "Notes", "Memo", "Letter", "Recipe", "Summary", "Minutes")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "house", "music", "paper", "horse", "light", "table", "water")
ORDINALS = ("first", "second", "third", "fourth")
IMAGE_KINDS = ("gui", "docs", "mixed")
MAX_IMAGES = len(ORDINALS)
MAX_ELEMENTS = 4
DEFAULT_SIZE = (112, 112)

#: Every answer is one of these (``Example.choices`` is the set of its question, cut to the number
#: of images for ordinals).
ANSWER_SETS: dict[str, tuple[str, ...]] = {
    "colour": tuple(COLOURS), "cell": CELLS, "label": LABELS, "ordinal": ORDINALS, "title": TITLES, "word": WORDS,
}

GUI_BACKGROUND = (160, 160, 160)
PAGE_BACKGROUND = (250, 250, 245)
_MIN_SIDE, _MAX_SIDE = 56, 1024


@dataclass(frozen=True)
class QuestionType:
    name: str
    image_kind: str  # "gui" or "docs": the kind of image the question is about
    answers: str  # a key of ANSWER_SETS
    min_images: int


QUESTIONS: dict[str, QuestionType] = {q.name: q for q in (
    QuestionType("colour", "gui", "colour", 1), QuestionType("where", "gui", "cell", 1),
    QuestionType("label", "gui", "label", 1), QuestionType("which", "gui", "ordinal", 2),
    QuestionType("title", "docs", "title", 1), QuestionType("word", "docs", "word", 1),
    QuestionType("before", "docs", "title", 2), QuestionType("which_page", "docs", "ordinal", 2),
)}


# ----------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Element:
    """One GUI element: ``kind`` in KINDS, ``colour`` in COLOURS, ``label`` in LABELS, ``cell`` in CELLS."""

    kind: str
    colour: str
    label: str
    cell: str

    def __str__(self) -> str:
        return f"{self.colour} {self.kind} {self.label} at {self.cell}"


@dataclass(frozen=True)
class ImageSpec:
    """What an image shows; :func:`render` draws it (``seed`` only moves shapes by a few pixels).

    ``kind`` 'gui': ``elements`` (1-4, sorted by cell, distinct cells, colours and labels);
    ``kind`` 'docs': ``title`` and ``lines`` (2-4 lines of words). ``size`` is (height, width).
    """

    kind: str
    size: tuple[int, int]
    seed: int
    elements: tuple[Element, ...] = ()
    title: str = ""
    lines: tuple[tuple[str, ...], ...] = ()

    def element_at(self, cell: str) -> Element | None:
        return next((e for e in self.elements if e.cell == cell), None)

    def find(self, *, label: str | None = None, colour: str | None = None, kind: str | None = None) -> list[Element]:
        """The elements matching every given attribute."""
        return [e for e in self.elements if (label is None or e.label == label)
                and (colour is None or e.colour == colour) and (kind is None or e.kind == kind)]


def describe(spec: ImageSpec) -> str:
    """Every element of ``spec`` in one line, the dense supervision text:
    'red button Save at top left; blue field Find at center' or 'title Budget; line 1: apple river; ...'."""
    if spec.kind == "gui":
        return "; ".join(str(e) for e in spec.elements)
    return "; ".join([f"title {spec.title}", *(f"line {i + 1}: {' '.join(words)}" for i, words in enumerate(spec.lines))])


# ------------------------------------------------------------------------------------- rendering


def _check_size(size) -> tuple[int, int]:
    if isinstance(size, (str, bytes)) or not isinstance(size, Sequence) or len(size) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not _MIN_SIDE <= v <= _MAX_SIDE for v in size):
        raise ValueError(f"size must be (height, width), each an int in [{_MIN_SIDE}, {_MAX_SIDE}] pixels, got {size!r}")
    return int(size[0]), int(size[1])


@functools.lru_cache(maxsize=64)
def _font(px: int):
    """PIL's default font at ``px`` pixels, or None where Pillow has no FreeType (then text is the
    bitmap font scaled up, see ``_text``)."""
    from PIL import ImageFont, features

    if not features.check("freetype2"):
        return None
    try:
        return ImageFont.load_default(size=px)
    except TypeError:  # Pillow < 10.1: no size argument
        return None


def _bitmap_font():
    """PIL's built-in bitmap font (about 11 pixels high), the fallback without FreeType."""
    from PIL import ImageFont

    return getattr(ImageFont, "load_default_imagefont", ImageFont.load_default)()


def _text_width(text: str, px: int) -> int:
    font = _font(px)
    if font is not None:
        box = font.getbbox(text)
        return box[2] - box[0]
    box = _bitmap_font().getbbox(text)
    return (box[2] - box[0]) * max(1, round(px / 11))


@functools.lru_cache(maxsize=64)
def _fitting_px(words: tuple[str, ...], width: int, cap: int) -> int:
    """The largest font size (<= cap) at which every one of ``words`` is at most ``width`` wide."""
    px = max(6, cap)
    while px > 6 and max(_text_width(w, px) for w in words) > width:
        px -= 1
    return px


def _text(img, xy: tuple[float, float], text: str, px: int, fill, anchor: str) -> None:
    """Draw ``text`` about ``xy`` (``anchor`` 'mm' = centred, 'lt' = left-top) ``px`` pixels high."""
    from PIL import Image, ImageDraw

    font = _font(px)
    if font is not None:
        ImageDraw.Draw(img).text(xy, text, fill=fill, font=font, anchor=anchor)
        return
    small = _bitmap_font()
    x0, y0, x1, y1 = small.getbbox(text)
    mask = Image.new("L", (x1 - x0 + 1, y1 - y0 + 1), 0)
    ImageDraw.Draw(mask).text((-x0, -y0), text, fill=255, font=small)
    scale = max(1, round(px / 11))
    mask = mask.resize((mask.width * scale, mask.height * scale), Image.NEAREST)
    x, y = xy
    if anchor == "mm":
        x, y = x - mask.width / 2, y - mask.height / 2
    img.paste(Image.new("RGB", mask.size, fill), (round(x), round(y)), mask)


def _ink_on(colour: tuple[int, int, int]) -> tuple[int, int, int]:
    r, g, b = colour
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 128 else (255, 255, 255)


def cell_box(size: tuple[int, int], cell: str) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of ``cell`` of the 3x3 grid on an image of ``size`` (height, width), x1/y1 exclusive."""
    h, w = _check_size(size)
    i = CELLS.index(cell)
    r, c = divmod(i, 3)
    return c * w // 3, r * h // 3, (c + 1) * w // 3, (r + 1) * h // 3


def _gui_geometry(size: tuple[int, int]) -> tuple[int, int, int, int]:
    """(margin, jitter, field outline width, label font px) of screenshots of ``size``."""
    h, w = size
    ch, cw = h // 3, w // 3
    margin = max(2, min(ch, cw) // 12)
    jitter = margin // 2
    outline = max(2, min(ch, cw) // 18)
    inner = cw - 2 * margin - 2 * outline - 2  # the label fits inside a field's outline and a circle
    return margin, jitter, outline, _fitting_px(LABELS, inner, int(ch * 0.34))


def _render_gui(spec: ImageSpec):
    from PIL import Image, ImageDraw

    h, w = spec.size
    img = Image.new("RGB", (w, h), GUI_BACKGROUND)
    draw = ImageDraw.Draw(img)
    margin, jitter, outline, px = _gui_geometry(spec.size)
    rng = np.random.default_rng(spec.seed)
    for e in spec.elements:
        x0, y0, x1, y1 = cell_box(spec.size, e.cell)
        dx, dy = (int(v) for v in rng.integers(-jitter, jitter + 1, 2))
        box = [x0 + margin + dx, y0 + margin + dy, x1 - 1 - margin + dx, y1 - 1 - margin + dy]
        colour = COLOURS[e.colour]
        if e.kind == "button":
            draw.rounded_rectangle(box, radius=max(2, (box[3] - box[1]) // 5), fill=colour)
            ink = _ink_on(colour)
        elif e.kind == "field":
            draw.rectangle(box, fill=GUI_BACKGROUND, outline=colour, width=outline)
            ink = (0, 0, 0)
        else:  # icon
            d = min(box[2] - box[0], box[3] - box[1])
            cx, cy = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
            draw.ellipse([cx - d // 2, cy - d // 2, cx - d // 2 + d, cy - d // 2 + d], fill=colour)
            ink = _ink_on(colour)
        _text(img, ((box[0] + box[2] + 1) / 2, (box[1] + box[3] + 1) / 2), e.label, px, ink, "mm")
    return img


def _render_page(spec: ImageSpec):
    from PIL import Image, ImageDraw

    h, w = spec.size
    img = Image.new("RGB", (w, h), PAGE_BACKGROUND)
    draw = ImageDraw.Draw(img)
    margin = max(3, w // 16)
    rng = np.random.default_rng(spec.seed)
    dx, dy = (int(v) for v in rng.integers(0, margin // 2 + 1, 2))
    title_px = _fitting_px(TITLES, w - 2 * margin - margin // 2, h // 6)
    line_px = _fitting_px(tuple(f"{a} {b}" for a in WORDS for b in WORDS if a != b), w - 2 * margin - margin // 2,
                          h // 9)
    x, y = margin + dx, margin + dy
    _text(img, (x, y), spec.title, title_px, (0, 0, 0), "lt")
    y += title_px + max(2, h // 28)
    draw.rectangle([x, y, w - margin - 1, y + max(1, h // 56)], fill=(60, 60, 60))
    y += max(4, h // 14)
    step = (h - margin - y) // 4
    for words in spec.lines:
        _text(img, (x, y), " ".join(words), line_px, (30, 30, 30), "lt")
        y += step
    return img


@functools.lru_cache(maxsize=256)
def render(spec: ImageSpec) -> np.ndarray:
    """The HxWx3 uint8 pixels of ``spec`` (cached and read-only: the same spec gives the same array)."""
    img = _render_gui(spec) if spec.kind == "gui" else _render_page(spec)
    arr = np.asarray(img).copy()
    arr.flags.writeable = False
    return arr


# ------------------------------------------------------------------------------- random specs


def _pick(rng: np.random.Generator, options: Sequence, exclude=()) -> str:
    pool = [o for o in options if o not in set(exclude)]
    return pool[int(rng.integers(len(pool)))]


def _random_gui(rng: np.random.Generator, size: tuple[int, int]) -> ImageSpec:
    n = int(rng.integers(1, MAX_ELEMENTS + 1))
    cells = sorted(int(i) for i in rng.choice(len(CELLS), n, replace=False))
    colours = rng.choice(len(COLOURS), n, replace=False)
    labels = rng.choice(len(LABELS), n, replace=False)
    kinds = rng.integers(0, len(KINDS), n)
    elements = tuple(Element(KINDS[int(k)], tuple(COLOURS)[int(c)], LABELS[int(lb)], CELLS[cell])
                     for k, c, lb, cell in zip(kinds, colours, labels, cells))
    return ImageSpec("gui", size, int(rng.integers(2**31)), elements)


def _random_page(rng: np.random.Generator, size: tuple[int, int], title: str) -> ImageSpec:
    n = int(rng.integers(2, 5))
    lines = tuple(tuple(WORDS[int(i)] for i in rng.choice(len(WORDS), 2, replace=False)) for _ in range(n))
    return ImageSpec("docs", size, int(rng.integers(2**31)), title=title, lines=lines)


def _put(rng: np.random.Generator, spec: ImageSpec, new: Element, keep: Element | None = None) -> ImageSpec:
    """``spec`` with ``new`` placed at its cell (replacing what was there); other elements that
    share its colour or label get fresh ones, and one is dropped if there would be more than
    MAX_ELEMENTS (never ``keep``)."""
    others = [e for e in spec.elements if e.cell != new.cell]
    if len(others) >= MAX_ELEMENTS:
        drop = [e for e in others if e != keep]
        others.remove(drop[int(rng.integers(len(drop)))])
    fixed = []
    for e in others:
        used_c = {new.colour, *(o.colour for o in others if o is not e)}
        used_l = {new.label, *(o.label for o in others if o is not e)}
        if e.colour == new.colour:
            e = replace(e, colour=_pick(rng, tuple(COLOURS), used_c))
        if e.label == new.label:
            e = replace(e, label=_pick(rng, LABELS, used_l))
        fixed.append(e)
    return replace(spec, elements=tuple(sorted([*fixed, new], key=lambda e: CELLS.index(e.cell))))


def _without_label(rng: np.random.Generator, spec: ImageSpec, label: str, avoid: set[str]) -> ImageSpec:
    """``spec`` with any element labelled ``label`` relabelled (avoiding ``avoid`` and its own labels)."""
    used = {e.label for e in spec.elements} | avoid | {label}
    return replace(spec, elements=tuple(replace(e, label=_pick(rng, LABELS, used)) if e.label == label else e
                                        for e in spec.elements))


# ------------------------------------------------------------------------------------ questions


def _noun(image_kind: str, family: str) -> str:
    return "image" if family == "mixed" else ("screenshot" if image_kind == "gui" else "page")


def _phrase(qtype: str, n: int, target: int, noun: str, *, element: Element | None = None, line: int = 0,
            title: str = "") -> str:
    """The question text. With several images the ordinal names ``target``."""
    of = f" of the {ORDINALS[target]} {noun}" if n > 1 else ""
    in_ = f" in the {ORDINALS[target]} {noun}" if n > 1 else ""
    e = element
    if qtype == "colour":
        return f"What colour is the {e.kind} in the {e.cell}{of}?"
    if qtype == "where":
        return f"Where is the {e.label} {e.kind}{in_}?"
    if qtype == "label":
        return f"What is the label of the {e.colour} {e.kind}{in_}?"
    if qtype == "which":
        return f"Which {noun} shows the {e.label} {e.kind}?"
    if qtype == "title":
        return f"What is the title of the {ORDINALS[target]} {noun}?" if n > 1 else "What is the title of this page?"
    if qtype == "word":
        return f"What is the first word of the {ORDINALS[line]} line{of}?"
    if qtype == "before":
        return "What is the title of the page shown before this one?"
    if qtype == "which_page":
        return f"Which {noun} has the title {title}?"
    raise AssertionError(qtype)


def _answer(qtype: str, specs: Sequence[ImageSpec], target: int, *, element: Element | None = None,
            line: int = 0) -> str:
    if qtype == "colour":
        return element.colour
    if qtype == "where":
        return element.cell
    if qtype == "label":
        return element.label
    if qtype in ("which", "which_page"):
        return ORDINALS[target]
    if qtype in ("title", "before"):
        return specs[target].title
    if qtype == "word":
        return specs[target].lines[line][0]
    raise AssertionError(qtype)


def _choices(qtype: str, n: int) -> tuple[str, ...]:
    answers = ANSWER_SETS[QUESTIONS[qtype].answers]
    return answers[:n] if answers is ORDINALS else answers


def _applicable(qtype: str, kinds: Sequence[str]) -> bool:
    """Whether ``qtype`` can be asked of images of ``kinds`` (in order) as they stand."""
    q = QUESTIONS[qtype]
    if len(kinds) < q.min_images:
        return False
    if qtype == "before":
        return kinds[-1] == "docs" and kinds[-2] == "docs"
    return q.image_kind in kinds


@dataclass
class Example:
    """One question over ``images`` (HxWx3 uint8, in prompt order) drawn from ``specs``.

    ``kind``: the image family ('gui', 'docs' or 'mixed'); ``question_type``: a key of QUESTIONS;
    ``target_image``: the index of the image that holds the answer; ``choices``: the closed set the
    answer is from."""

    images: list[np.ndarray]
    specs: tuple[ImageSpec, ...]
    question: str
    answer: str
    choices: tuple[str, ...]
    kind: str
    question_type: str
    target_image: int
    seed: int


def _check_common(num_images, kind, question, size) -> tuple[int, str, str | None, tuple[int, int]]:
    if isinstance(num_images, bool) or not isinstance(num_images, (int, np.integer)) or not 1 <= num_images <= MAX_IMAGES:
        raise ValueError(f"num_images must be an int in 1..{MAX_IMAGES}, got {num_images!r}")
    if kind not in IMAGE_KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(IMAGE_KINDS)}")
    if question is not None:
        if question not in QUESTIONS:
            raise ValueError(f"unknown question {question!r}; choose from {', '.join(QUESTIONS)}")
        q = QUESTIONS[question]
        if kind != "mixed" and q.image_kind != kind:
            raise ValueError(f"question {question!r} is about {q.image_kind} images, not {kind}")
        if num_images < q.min_images:
            raise ValueError(f"question {question!r} needs at least {q.min_images} images, got num_images={num_images}")
    return int(num_images), kind, question, _check_size(size)


def make_example(seed: int, *, num_images: int = 1, kind: str = "gui", question: str | None = None,
                 size: tuple[int, int] = DEFAULT_SIZE) -> Example:
    """One example drawn from ``seed``: ``num_images`` images of ``kind`` ('gui', 'docs' or 'mixed')
    and a question of type ``question`` (a key of QUESTIONS; None = any that fits, uniformly)."""
    check_seed(seed)
    n, kind, question, size = _check_common(num_images, kind, question, size)
    rng = np.random.default_rng(seed)
    if question is None:
        kinds_ok = ("gui", "docs") if kind == "mixed" else (kind,)
        names = [q.name for q in QUESTIONS.values() if q.image_kind in kinds_ok and n >= q.min_images]
        question = names[int(rng.integers(len(names)))]
    q = QUESTIONS[question]
    target = n - 2 if question == "before" else int(rng.integers(n))
    if kind == "mixed":
        kinds = ["gui" if rng.random() < 0.5 else "docs" for _ in range(n)]
        kinds[target] = q.image_kind
        if question == "before":
            kinds[-1] = "docs"
    else:
        kinds = [kind] * n
    titles = iter(rng.permutation(TITLES)[:n])  # titles differ between pages
    specs = [_random_gui(rng, size) if k == "gui" else _random_page(rng, size, str(next(titles))) for k in kinds]
    element, line = None, 0
    if q.image_kind == "gui":
        t = specs[target]
        element = t.elements[int(rng.integers(len(t.elements)))]
        others = [i for i in range(n) if i != target and kinds[i] == "gui"]
        for i in others:
            if question == "which":  # the label is in the target only
                specs[i] = _without_label(rng, specs[i], element.label, set())
            elif rng.random() < 0.5:  # a distractor: only the named image gives the answer
                if question == "colour":
                    new = Element(element.kind, _pick(rng, tuple(COLOURS), {element.colour}), _pick(rng, LABELS),
                                  element.cell)
                elif question == "where":
                    new = Element(element.kind, _pick(rng, tuple(COLOURS)), element.label,
                                  _pick(rng, CELLS, {element.cell}))
                else:  # label
                    new = Element(element.kind, element.colour, _pick(rng, LABELS, {element.label}), _pick(rng, CELLS))
                specs[i] = _put(rng, specs[i], new)
    elif question == "word":
        line = int(rng.integers(len(specs[target].lines)))
    text = _phrase(question, n, target, _noun(q.image_kind, kind), element=element, line=line,
                   title=specs[target].title)
    return Example(images=[render(s) for s in specs], specs=tuple(specs), question=text,
                   answer=_answer(question, specs, target, element=element, line=line),
                   choices=_choices(question, n), kind=kind, question_type=question, target_image=target, seed=seed)


SPLITS = ("train", "test")
_STREAM_LIMIT = 2**30  # base seeds; example seeds stay below 2**63


def split_seed(split: str, index: int, seed: int = 0) -> int:
    """The example seed of ``index`` in ``split``'s stream under ``seed``: train seeds are even,
    test seeds odd, so the two splits never share a seed."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _STREAM_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**30), got {seed!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**32:
        raise ValueError(f"index must be an int in [0, 2**32), got {index!r}")
    return ((seed << 32) + index) * 2 + SPLITS.index(split)


def examples(split: str, n: int, *, num_images: int = 1, kind: str = "gui", question: str | None = None,
             seed: int = 0, size: tuple[int, int] = DEFAULT_SIZE) -> Iterator[Example]:
    """``n`` examples of ``split`` ('train' or 'test'), example i from ``split_seed(split, i, seed)``."""
    split_seed(split, 0, seed)
    check_int("n", n, 0)
    _check_common(num_images, kind, question, size)
    return (make_example(split_seed(split, i, seed), num_images=num_images, kind=kind, question=question, size=size)
            for i in range(n))


DENSE_INSTRUCTION = "Describe every element, then answer."


def dense_reply(example: Example, *, evidence: bool = False) -> str:
    """The dense-supervision reply: every image described, then 'Answer: <answer>'. With
    ``evidence`` a line 'Found: ...' first repeats the question's keys, then the part of the
    description that holds the answer (:func:`evidence_line`), so the answer is copied from the
    line just above it."""
    found = evidence_line(example) if evidence else None
    return _dense_text(example.specs, example.kind, example.answer, found)


def evidence_line(example: Example) -> str:
    """The 'Found:' line of a dense reply: the keys the question gives (the image's ordinal when
    there are several, then the element's known attributes), a colon, then the part of the
    description that holds the answer. A 'which' question names no image, so its line checks them
    in order ('first screenshot, Save button: none; second screenshot, Save button: red button Save
    at top left') and stops at the one that holds the element.

    Why keys first: a line that starts with what is being looked up ('third screenshot, Find
    button: ...') lets the model write it by copying from the question, and then continue it by
    copying from the description after the same words, which a small model learns. A line that
    starts with the answer ('Third screenshot: ...' for 'which screenshot shows ...?') asks it to
    know the answer before writing anything: run 6 wrote such lines right 29% of the time with
    87% of the descriptions exact (docs/benchmark.md). The old 'which' line ('Save button: red
    button Save at top left in the second screenshot') had to find the element among all the
    images at once: run 22 wrote it right 7 times in 28 (chance is 1 in 4) while describing 99.5%
    of the parts right and getting the keyed questions 92% right."""
    return _evidence(example.specs, example.kind, example.question_type, example.question,
                     example.answer, example.target_image)


def _evidence(specs: Sequence[ImageSpec], family: str, qtype: str, question: str, answer: str, target: int) -> str:
    spec = specs[target]
    place = f"{ORDINALS[target]} {_noun(spec.kind, family)}"
    at = f"{place}, " if len(specs) > 1 else ""
    if spec.kind == "gui":
        element = next(e for e in spec.elements
                       if answer in (e.colour, e.cell, e.label) or f" {e.label} {e.kind}" in question)
        if qtype == "which":
            # Image by image in order, each checked the way a 'where' line checks the image it names.
            keys = f"{element.label} {element.kind}"
            noun = _noun(spec.kind, family)
            return "; ".join([*(f"{ORDINALS[i]} {noun}, {keys}: none" for i in range(target)),
                              f"{place}, {keys}: {element}"])
        keys = {"colour": f"{element.kind} at {element.cell}", "where": f"{element.label} {element.kind}",
                "label": f"{element.colour} {element.kind}"}[qtype]
        return f"{at}{keys}: {element}"
    if qtype == "word":
        line = next(k for k, ordinal in enumerate(ORDINALS) if f"the {ordinal} line" in question)
        return f"{at}{ORDINALS[line]} line: line {line + 1}: {' '.join(spec.lines[line])}"
    if qtype == "which_page":
        return f"title {spec.title}: the {place}"
    return f"{at}title: title {spec.title}" if len(specs) > 1 else f"title {spec.title}"


def _dense_text(specs: Sequence[ImageSpec], family: str, answer: str, found: str | None = None) -> str:
    if len(specs) == 1:
        lines = [describe(specs[0])]
    else:
        lines = [f"{ORDINALS[i].capitalize()} {_noun(s.kind, family)}: {describe(s)}" for i, s in enumerate(specs)]
    if found is not None:
        lines.append(f"Found: {found}")
    return "\n".join([*lines, f"Answer: {answer}"])


def dense_token_budget(num_images: int) -> int:
    """Enough new tokens for a dense reply about ``num_images`` images with the project's
    tokenizer: up to 4 elements of up to 15 tokens per image, a header per image, the evidence
    line and the answer (the longest replies with evidence over 1,500 seeds of each kind take 98,
    169, 235 and 309 tokens for 1-4 images; a budget too short cuts the answer off and scores a
    right reply as wrong, and a trained model stops at the reply's end, well inside it)."""
    return 48 + 72 * num_images


def messages(example: Example, *, dense: bool = False, system: str | None = None,
             answer: bool = True, evidence: bool = False) -> list[dict]:
    """Chat messages in samcache's format: [system,] the user turn (images, then the question) and,
    if ``answer``, the assistant's reply: the answer alone, or with ``dense`` the description of
    every image then 'Answer: ...' (the question then asks for that: DENSE_INSTRUCTION)."""
    prompt = f"{example.question} {DENSE_INSTRUCTION}" if dense else example.question
    out = [{"role": "system", "content": system}] if system is not None else []
    out.append(user_message(list(example.images), prompt))
    if answer:
        out.append({"role": "assistant", "content": dense_reply(example, evidence=evidence) if dense else example.answer})
    return out


def parse_answer(reply: str) -> str:
    """The answer in a model's ``reply``: what follows the last 'Answer:' (if any), stripped of
    spaces and a final full stop."""
    text = reply.rsplit("Answer:", 1)[-1] if "Answer:" in reply else reply
    return text.strip().rstrip(".").strip()


def is_correct(reply: str, answer: str) -> bool:
    """Whether ``reply`` gives ``answer`` (case-insensitive, see :func:`parse_answer`)."""
    return parse_answer(reply).lower() == answer.strip().lower()


def described_parts(reply: str, specs: Sequence[ImageSpec]) -> list[bool]:
    """For every part of every image's description (the parts of :func:`describe`: an element, a
    title, a line of words), whether ``reply`` gives it exactly in that image's line ('Second
    screenshot: ...' when there are several, the first line for one image).

    Finer than the answer: a turn of three screenshots has about ten parts, so a model that reads an
    image differently (reused KV at a new position, say) shows it even where the answer stays
    right, and where the answer is wrong for other reasons."""
    if not isinstance(reply, str):
        raise TypeError(f"reply must be a str, got {type(reply).__name__}")
    if not specs or not all(isinstance(s, ImageSpec) for s in specs):
        raise ValueError("specs must be a non-empty sequence of ImageSpec (the images the reply describes)")
    body = [line.strip() for line in reply.splitlines()]
    body = [line for line in body if line and not line.startswith(("Found:", "Answer:"))]
    lines: dict[int, str] = {}
    if len(specs) == 1:
        lines[0] = body[0] if body else ""
    else:
        for line in body:
            head, sep, rest = line.partition(": ")
            words = head.lower().split()
            if sep and len(words) == 2 and words[0] in ORDINALS:
                lines.setdefault(ORDINALS.index(words[0]), rest)
    out = []
    for i, spec in enumerate(specs):
        given = {part.strip() for part in lines.get(i, "").split(";")}
        out += [part in given for part in describe(spec).split("; ")]
    return out


# --------------------------------------------------------------------------------------- traces

SCENARIOS = ("gui", "reorder", "subagent", "handoff")
#: The traces' system prompts (``{index}``: the sub-agent's number). Without ``dense`` each gets
#: ANSWER_HINT appended; the training script frames part of its examples with them.
SYSTEM_PROMPTS = {
    "gui": "You are a GUI agent. You see your last screenshots, oldest first.",
    "reorder": "You are a document analyst. Answer from the pages shown.",
    "planner": "You are a planner for a GUI agent.",
    "subagent": "You are sub-agent {index}, checking one part of the screens.",
}
ANSWER_HINT = "Answer in one or two words."


@dataclass
class Turn:
    """One request of a trace: ``messages`` (the whole request, images as pixel arrays, ending with
    the user's question), the expected ``answer`` and its ``choices``. ``image_ids`` names each image
    of the request (in order of appearance) by its index in ``specs`` of the trace, so the same id
    at another index is the same image moved; ``target_image`` indexes the images of this request."""

    label: str
    messages: list[dict]
    answer: str
    choices: tuple[str, ...]
    question_type: str
    target_image: int
    image_ids: tuple[int, ...]
    specs: tuple[ImageSpec, ...] = field(repr=False, default=())
    max_new_tokens: int = 8

    def images(self) -> list[np.ndarray]:
        return [p["image"] for m in self.messages if not isinstance(m["content"], str)
                for p in m["content"] if p.get("type") == "image"]

    @property
    def question(self) -> str:
        content = self.messages[-1]["content"]
        return content if isinstance(content, str) else " ".join(p["text"] for p in content if p.get("type") == "text")


def _ask(rng: np.random.Generator, specs: Sequence[ImageSpec], family: str) -> tuple[str, str, str, int]:
    """A question about ``specs`` as they are (nothing is changed): (type, text, answer, target).
    Types are drawn uniformly among those with a valid instance, then the instance uniformly."""
    n, kinds = len(specs), [s.kind for s in specs]
    label_count: dict[str, int] = {}
    for s in specs:
        for e in s.elements:
            label_count[e.label] = label_count.get(e.label, 0) + 1
    options: dict[str, list[tuple[int, dict]]] = {}
    for qt, qtype in QUESTIONS.items():
        if not _applicable(qt, kinds):
            continue
        if qt == "before":
            options[qt] = [(n - 2, {})]
            continue
        cands = []
        for i, s in enumerate(specs):
            if s.kind != qtype.image_kind:
                continue
            if qt in ("colour", "where", "label"):
                cands += [(i, {"element": e}) for e in s.elements]
            elif qt == "which":
                cands += [(i, {"element": e}) for e in s.elements if label_count[e.label] == 1]
            elif qt == "word":
                cands += [(i, {"line": k}) for k in range(len(s.lines))]
            elif qt == "which_page":
                if sum(o.title == s.title for o in specs) == 1:
                    cands.append((i, {}))
            else:  # title
                cands.append((i, {}))
        if cands:
            options[qt] = cands
    qt = list(options)[int(rng.integers(len(options)))]
    target, kw = options[qt][int(rng.integers(len(options[qt])))]
    noun = _noun(QUESTIONS[qt].image_kind, family)
    return (qt, _phrase(qt, n, target, noun, title=specs[target].title, **kw),
            _answer(qt, specs, target, **kw), target)


def framed_messages(example: Example, seed: int, *, dense: bool = True, evidence: bool = False) -> list[dict]:
    """``example`` as the traces send it, for training a model that answers them: drawn from
    ``seed``, half the time a trace's system prompt (SYSTEM_PROMPTS, the one of the example's
    family), for GUI agents a 'Step k.' prefix half the time, and one time in five a second turn:
    the reply, then a text-only follow-up question about the same images (as the sub-agent
    traces continue). Every assistant turn is a training target."""
    check_seed(seed)
    rng = np.random.default_rng(seed)
    family = "reorder" if example.kind == "docs" else ("planner", "subagent", "gui")[int(rng.integers(3))]
    system = None
    if rng.random() < 0.5:
        text = SYSTEM_PROMPTS[family].format(index=int(rng.integers(MAX_IMAGES)))
        system = text if dense else f"{text} {ANSWER_HINT}"
    msgs = messages(example, dense=dense, system=system, evidence=evidence)
    if family == "gui" and rng.random() < 0.5:
        user = msgs[-2]
        user["content"][-1] = {"type": "text", "text": f"Step {int(rng.integers(10))}. {user['content'][-1]['text']}"}
    if rng.random() < 0.2:
        qtype, text, answer, target = _ask(rng, example.specs, example.kind)
        found = _evidence(example.specs, example.kind, qtype, text, answer, target) if evidence else None
        msgs.append({"role": "user", "content": f"{text} {DENSE_INSTRUCTION}" if dense else text})
        msgs.append({"role": "assistant",
                     "content": _dense_text(example.specs, example.kind, answer, found) if dense else answer})
    return msgs


def trace(seed: int, *, scenario: str = "gui", turns: int = 6, window: int = 3,
          size: tuple[int, int] = DEFAULT_SIZE, dense: bool = False) -> list[Turn]:
    """A multi-turn trace drawn from ``seed`` whose images move between turns, each turn with a
    known answer.

    - ``gui``: ``turns`` screenshots, turn t shows the last ``window`` of them (oldest first), so
      each turn drops the oldest, adds one and moves the rest up; the question names one by ordinal.
    - ``reorder``: ``window + 2`` pages (distinct titles); each turn shows ``window`` of them in a
      new order.
    - ``subagent``: ``window`` screenshots; a planner turn, then sub-agents (own system prompts) over
      the screenshots in a new order each, then the last sub-agent's conversation continued with its
      history (scripted correct replies) and text-only follow-up questions about its images.
    - ``handoff``: the control for the others: ``window`` screenshots handed on in the *same order*
      every turn, to an agent, a planner and numbered sub-agents in turn. Their system prompts
      differ in length and words, so the images move to other positions after other text, but
      each keeps its place among the images (first stays first). Reuse that fails here fails
      on position or context; reuse that fails only in the other scenarios fails on order.

    ``dense``: every question asks for the description first (DENSE_INSTRUCTION, as a model
    trained with dense replies expects), scripted replies are dense replies, and each turn's
    ``max_new_tokens`` leaves room for the description (:func:`dense_token_budget`).
    """
    check_seed(seed)
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    check_int("turns", turns, 1)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_IMAGES:
        raise ValueError(f"window must be an int in 1..{MAX_IMAGES}, got {window!r}")
    size = _check_size(size)
    rng = np.random.default_rng(seed)
    out: list[Turn] = []

    def system(role: str, **fields) -> dict:
        text = SYSTEM_PROMPTS[role].format(**fields)
        return {"role": "system", "content": text if dense else f"{text} {ANSWER_HINT}"}

    def ask(specs, family):
        qt, text, answer, target = _ask(rng, specs, family)
        return qt, (f"{text} {DENSE_INSTRUCTION}" if dense else text), answer, target

    def turn(label, msgs, ids, specs, qt, answer, target) -> Turn:
        budget = dense_token_budget(len(ids)) if dense else Turn.max_new_tokens
        return Turn(label, msgs, answer, _choices(qt, len(ids)), qt, target, tuple(ids), tuple(specs), budget)

    if scenario == "gui":
        pool = [_random_gui(rng, size) for _ in range(turns)]
        for t in range(turns):
            ids = list(range(max(0, t - window + 1), t + 1))
            specs = [pool[i] for i in ids]
            qt, text, answer, target = ask(specs, "gui")
            msgs = [system("gui"),
                    user_message([render(s) for s in specs], f"Step {t}. {text}")]
            out.append(turn(f"step {t}", msgs, ids, specs, qt, answer, target))
        return out

    if scenario == "reorder":
        titles = rng.permutation(TITLES)[:window + 2]
        pool = [_random_page(rng, size, str(ti)) for ti in titles]
        previous: list[int] = []
        for t in range(turns):
            ids = [int(i) for i in rng.permutation(len(pool))[:window]]
            while ids == previous:
                ids = [int(i) for i in rng.permutation(len(pool))[:window]]
            previous = ids
            specs = [pool[i] for i in ids]
            qt, text, answer, target = ask(specs, "docs")
            msgs = [system("reorder"), user_message([render(s) for s in specs], text)]
            out.append(turn(f"question {t}", msgs, ids, specs, qt, answer, target))
        return out

    if scenario == "handoff":
        pool = [_random_gui(rng, size) for _ in range(window)]
        ids = list(range(window))
        roles = ("gui", "planner", "subagent")
        for t in range(turns):
            qt, text, answer, target = ask(pool, "gui")
            role = roles[t % len(roles)]
            msgs = [system(role, index=t), user_message([render(s) for s in pool], text)]
            out.append(turn(f"{role} {t}", msgs, ids, pool, qt, answer, target))
        return out

    # subagent
    pool = [_random_gui(rng, size) for _ in range(window)]
    branches = turns // 2
    follow_ups = turns - 1 - branches
    ids = list(range(window))
    specs = [pool[i] for i in ids]
    qt, text, answer, target = ask(specs, "gui")
    out.append(turn("plan", [system("planner"),
                             user_message([render(s) for s in specs], text)], ids, specs, qt, answer, target))
    history: list[dict] = []
    for b in range(branches):
        order = [int(i) for i in rng.permutation(window)]
        if window > 1:
            while order == ids:
                order = [int(i) for i in rng.permutation(window)]
        ids = order
        specs = [pool[i] for i in ids]
        qt, text, answer, target = ask(specs, "gui")
        history = [system("subagent", index=b),
                   user_message([render(s) for s in specs], text)]
        out.append(turn(f"branch {b}", list(history), ids, specs, qt, answer, target))
    for c in range(follow_ups):
        qt, text, answer, target = ask(specs, "gui")
        scripted = _dense_text(specs, "gui", out[-1].answer) if dense else out[-1].answer
        history = [*history, {"role": "assistant", "content": scripted}, {"role": "user", "content": text}]
        out.append(turn(f"continue {c}", list(history), ids, specs, qt, answer, target))
    return out


__all__ = [
    "ANSWER_HINT", "ANSWER_SETS", "CELLS", "COLOURS", "DEFAULT_SIZE", "DENSE_INSTRUCTION", "IMAGE_KINDS", "KINDS", "LABELS",
    "MAX_IMAGES", "ORDINALS", "QUESTIONS", "SCENARIOS", "SPLITS", "TITLES", "WORDS", "Element", "Example",
    "ImageSpec", "QuestionType", "SYSTEM_PROMPTS", "Turn", "cell_box", "dense_reply", "dense_token_budget", "evidence_line", "framed_messages", "describe", "described_parts", "examples", "is_correct",
    "make_example", "messages", "parse_answer", "render", "split_seed", "trace",
]
