"""The eviction policy of an engine plugin's image-KV store: which images the store lets go first.

Plain LRU (the default) is the store's own order and tracks nothing. With the workflow-aware
policy (KVFlow) the store keeps the images of the agents that run soonest, so each request names
its agent, in the engine's own per-request field:

- vLLM: ``SamplingParams(extra_args={"kv_transfer_params": {"samcache_agent": "team/planner"}})``
  (the connector API's per-request parameters; ``kv_transfer_params`` in the OpenAI server's
  request body);
- SGLang: ``routing_key="team/planner"`` (SGLang's per-request grouping key; unlike ``extra_key``
  it does not split the cache, so agents share their images).

Agent names are ``"workflow/agent"``, the workflows come from ``eviction_options`` (see
:class:`~samcache.integrations.settings.ReuseSettings`). Each request moves its workflow on once,
whatever the number of forward steps its prompt takes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from samcache.policies.cache_priorities import CachePriorities
from samcache.integrations.settings import ReuseSettings
from samcache.policies import LRUPolicy

#: Request ids remembered to tell a request's first forward step from its later ones.
_REMEMBERED = 1 << 16


class StorePolicy:
    """``settings``' eviction policy applied to ``store`` (a store with a ContentIndex ``index``)."""

    def __init__(self, settings: ReuseSettings, store: Any) -> None:
        self.policy = settings.make_policy()
        self.priorities = None if isinstance(self.policy, LRUPolicy) else CachePriorities(self.policy, None, [store])
        self._seen: OrderedDict[Hashable, None] = OrderedDict()

    @property
    def tracks(self) -> bool:
        """Whether requests need to be observed at all (not for plain LRU)."""
        return self.priorities is not None

    def observe(self, request_id: Hashable, agent: str | None, images: Iterable[Hashable]) -> None:
        """A forward step of request ``request_id`` of ``agent`` (None: no agent named) whose
        prompt holds ``images`` (store keys)."""
        if self.priorities is None:
            return
        first = request_id not in self._seen
        if first:
            self._seen[request_id] = None
            if len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)
        self.priorities.record(agent if isinstance(agent, str) and agent else None, list(images), None,
                               advance=first)

    def apply(self) -> None:
        """Write every tracked image's priority into the store (before it inserts, i.e. evicts)."""
        if self.priorities is not None:
            self.priorities.apply()

    def priorities_now(self) -> dict:
        return {} if self.priorities is None else self.priorities.priorities()


__all__ = ["StorePolicy"]
