"""The reference engine: a model runner over Hugging Face modules with samcache's caches.

``SAMcacheEngine`` (also ``samcache.SAMcacheEngine``) is the entry point; the runner, the prompt
builder and the stores are its parts. See docs/design.md ("The engine").
"""

from samcache.engine.engine import ChatResult, ImageKV, SAMcacheEngine, Session, model_fingerprint
from samcache.engine.family import FAMILIES, Family, detect_family
from samcache.engine.metrics import Fidelity, TurnMetrics
from samcache.engine.prompt import Prompt, build_prompt
from samcache.engine.runner import ForwardBatch, ModelRunner
from samcache.engine.sampling import Sampler
from samcache.engine.synthetic import screenshot

__all__ = [
    "FAMILIES",
    "ChatResult",
    "Family",
    "Fidelity",
    "ForwardBatch",
    "ImageKV",
    "ModelRunner",
    "Prompt",
    "SAMcacheEngine",
    "Sampler",
    "Session",
    "TurnMetrics",
    "build_prompt",
    "detect_family",
    "model_fingerprint",
    "screenshot",
]
