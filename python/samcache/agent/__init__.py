"""Agent-aware memory: the branch context tree over the pool's copy-on-write forks
(:mod:`samcache.agent.branches`), large tool results kept out of the context
(:mod:`samcache.agent.tool_store`) and a deterministic context compressor
(:mod:`samcache.agent.compressor`)."""

from samcache.agent.branches import STATES, Branch, BranchMemory, ContextTree, TreeMemory

from samcache.agent.compressor import STAGES, Compressed, CompressorConfig, ContextCompressor, StageReport, approx_tokens
from samcache.agent.tool_store import StoredResult, ToolResultStore, content_key, references_in

__all__ = ["STAGES", "STATES", "Branch", "BranchMemory", "ContextTree", "TreeMemory", "Compressed", "CompressorConfig", "ContextCompressor", "StageReport", "StoredResult",
           "ToolResultStore", "approx_tokens", "content_key", "references_in"]
