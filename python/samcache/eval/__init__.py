"""Evaluation beside the serving path: how close a turn served with reuse is to a full prefill."""

from samcache.engine.fidelity import greedy_decode, measure_fidelity, reference_prefill

__all__ = ["greedy_decode", "measure_fidelity", "reference_prefill"]
