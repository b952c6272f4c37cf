"""The reference engine: a batched model runner over Hugging Face modules with samcache's caches.

Along the data flow: ``prompt`` / ``images`` (requests as tokens and positions), the planner
(``samcache.reuse``), ``executor`` (a plan's stages on the pool and stores), ``batch`` + ``runner``
(batched forward steps), ``scheduler`` (continuous batching of requests), ``api``
(``SAMcacheEngine``: chat and sessions). ``calibration`` and ``fidelity`` work beside the
serving path (``samcache.bench.task_accuracy`` builds task evaluations on them). See docs/design.md ("The engine").
"""

from samcache.engine.api import BatchError, ChatRequest, ChatResult, PreparedChat, SAMcacheEngine, Session
from samcache.engine.config import (CacheConfig, CompressionConfig, EngineConfig, EvictionConfig, RecomputeConfig,
                                    TierConfig)
from samcache.engine.batch import SequenceStep, StepBatch
from samcache.engine.executor import Executor, Prepared, RequestOptions
from samcache.families import FAMILIES, Family, detect_family, get_family
from samcache.engine.loading import load_processor, model_fingerprint, resolve_device, resolve_dtype
from samcache.engine.metrics import Fidelity, TurnMetrics
from samcache.engine.prompt import Prompt, build_prompt
from samcache.engine.runner import ModelRunner
from samcache.engine.sampling import Sampler
from samcache.engine.scheduler import Admission, Finished, Scheduler
from samcache.synthetic import screenshot

__all__ = [
    "FAMILIES",
    "Admission",
    "BatchError",
    "CacheConfig",
    "ChatRequest",
    "ChatResult",
    "CompressionConfig",
    "EngineConfig",
    "EvictionConfig",
    "Executor",
    "Family",
    "Fidelity",
    "Finished",
    "ModelRunner",
    "Prepared",
    "PreparedChat",
    "Prompt",
    "RecomputeConfig",
    "RequestOptions",
    "SAMcacheEngine",
    "Sampler",
    "Scheduler",
    "SequenceStep",
    "Session",
    "StepBatch",
    "TierConfig",
    "TurnMetrics",
    "build_prompt",
    "detect_family",
    "get_family",
    "load_processor",
    "model_fingerprint",
    "resolve_device",
    "resolve_dtype",
    "screenshot",
]
