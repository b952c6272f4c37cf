"""Measuring samcache: the agent workload benchmark (:mod:`~samcache.bench.workloads` traces,
:mod:`~samcache.bench.benchmark` modes and per-turn metrics, :mod:`~samcache.bench.report`
tables and plots), task accuracy under reuse on a trained model
(:mod:`~samcache.bench.task_accuracy`, behind ``samcache eval``) and the real peer engines run on
the same checkpoint and trace (:mod:`~samcache.bench.peers`). The scripts under the repository's
``bench/`` folder are thin entry points over these and the kernels."""
