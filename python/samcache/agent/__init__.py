"""Agent-aware memory beyond the KV cache: large tool results kept out of the context
(:mod:`samcache.agent.tool_store`) and a deterministic context compressor
(:mod:`samcache.agent.compressor`)."""

from samcache.agent.compressor import STAGES, Compressed, CompressorConfig, ContextCompressor, StageReport, approx_tokens
from samcache.agent.tool_store import StoredResult, ToolResultStore, content_key, references_in

__all__ = ["STAGES", "Compressed", "CompressorConfig", "ContextCompressor", "StageReport", "StoredResult",
           "ToolResultStore", "approx_tokens", "content_key", "references_in"]
