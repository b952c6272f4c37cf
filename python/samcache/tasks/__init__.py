"""Synthetic tasks with known answers, drawn locally: the visual QA family
(:mod:`samcache.tasks.visual_qa`) that a tiny VLM is trained on and that measures fidelity under KV
reuse as task accuracy. The training script is :mod:`samcache.tasks.training` (imports torch; not
imported here)."""

from samcache.tasks.visual_qa import (
    ANSWER_SETS,
    QUESTIONS,
    SCENARIOS,
    Element,
    Example,
    ImageSpec,
    Turn,
    describe,
    examples,
    is_correct,
    make_example,
    messages,
    parse_answer,
    render,
    split_seed,
    trace,
)

__all__ = ["ANSWER_SETS", "QUESTIONS", "SCENARIOS", "Element", "Example", "ImageSpec", "Turn", "describe", "examples",
           "is_correct", "make_example", "messages", "parse_answer", "render", "split_seed", "trace"]
