"""Workflow-aware eviction and prefetch (KVFlow): in a multi-agent workflow the agents run in a
known order, so the KV of the agent that runs next is worth more than the most recently used.

A :class:`Workflow` is the plan: agents and what each waits for (a DAG), run in a deterministic
topological order, once or repeated (a planner -> workers -> reviewer loop). Several workflows
can run at once (:class:`WorkflowAwarePolicy` takes them all). An item's priority is minus its
*steps to execution*: the number of agent steps until the soonest agent that needs it runs
(0: the agent running now). Items no planned agent needs get the lowest priority and go first.
The same step counts say what to prefetch: the items of the next agents, before their turn.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from samcache._checks import check_int
from samcache.policies.base import PRIORITY_MIN, EvictionPolicy, ItemState, clamp_priority

#: Steps to execution of an agent that will not run again.
NEVER = float("inf")


@dataclass
class Workflow:
    """Agents and their dependencies (``after``: agent -> the agents it waits for), run in a
    topological order (ties by the order agents were given), ``repeat``-ed forever or once.
    :meth:`advance` marks the current step done."""

    name: str
    after: Mapping[str, Sequence[str]]
    repeat: bool = True
    order: list[str] = field(init=False)
    cursor: int = field(default=0, init=False)

    def __post_init__(self):
        agents = list(self.after)
        unknown = sorted({d for deps in self.after.values() for d in deps} - set(agents))
        if unknown:
            raise ValueError(f"workflow {self.name!r}: agents {unknown} are waited for but not declared")
        if not agents:
            raise ValueError(f"workflow {self.name!r} has no agents")
        order, done = [], set()
        while len(order) < len(agents):
            ready = [a for a in agents if a not in done and all(d in done for d in self.after[a])]
            if not ready:
                cycle = sorted(set(agents) - done)
                raise ValueError(f"workflow {self.name!r} has a dependency cycle among {cycle}")
            order.append(ready[0])
            done.add(ready[0])
        self.order = order

    @classmethod
    def from_spec(cls, spec: Mapping) -> Workflow:
        """A workflow from plain data (a plugin's JSON options): ``{"name": ..., "agents": [...]}``
        (one after another) or ``{"name": ..., "after": {agent: [agents it waits for]}}``, with an
        optional ``"repeat"`` (default true)."""
        if isinstance(spec, Workflow):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"a workflow must be an object with 'name' and 'agents' or 'after', got {spec!r}")
        unknown = sorted(set(spec) - {"name", "agents", "after", "repeat"})
        name, repeat = spec.get("name"), spec.get("repeat", True)
        if unknown or not isinstance(name, str) or not name or not isinstance(repeat, bool) \
                or ("agents" in spec) == ("after" in spec):
            raise ValueError(f"a workflow is {{'name': str, 'agents': [...] or 'after': {{agent: [...]}}, "
                             f"'repeat': bool}}, got {dict(spec)!r}")
        if "agents" in spec:
            agents = spec["agents"]
            if isinstance(agents, str) or not all(isinstance(a, str) and a for a in agents):
                raise ValueError(f"workflow {name!r}: 'agents' must be a list of names, got {agents!r}")
            return cls.sequence(name, list(agents), repeat=repeat)
        after = spec["after"]
        if not isinstance(after, Mapping) or not all(isinstance(d, (list, tuple)) for d in after.values()):
            raise ValueError(f"workflow {name!r}: 'after' must map each agent to a list of agents, got {after!r}")
        return cls(name, {a: list(d) for a, d in after.items()}, repeat=repeat)

    @classmethod
    def sequence(cls, name: str, agents: Sequence[str], *, repeat: bool = True) -> Workflow:
        """Agents that run one after another in the given order."""
        if len(set(agents)) != len(agents):
            raise ValueError(f"workflow {name!r}: agents must be distinct, got {list(agents)}")
        return cls(name, {a: ([agents[i - 1]] if i else []) for i, a in enumerate(agents)}, repeat=repeat)

    @property
    def current(self) -> str | None:
        """The agent that runs now (None when a one-shot workflow is finished)."""
        if not self.repeat and self.cursor >= len(self.order):
            return None
        return self.order[self.cursor % len(self.order)]

    def advance(self) -> None:
        self.cursor += 1

    def steps_until(self, agent: str) -> float:
        """Steps until ``agent`` runs next (0: it runs now); NEVER if it will not."""
        if agent not in self.after:
            return NEVER
        n = len(self.order)
        for ahead in range(n):
            step = self.cursor + ahead
            if not self.repeat and step >= n:
                return NEVER
            if self.order[step % n] == agent:
                return ahead
        return NEVER

    def upcoming(self, horizon: int) -> list[str]:
        """The agents of the next ``horizon`` steps, the current one first."""
        n = len(self.order)
        steps = range(self.cursor, self.cursor + horizon)
        return [self.order[s % n] for s in steps if self.repeat or s < n]


class WorkflowAwarePolicy(EvictionPolicy):
    """Priority = minus the steps until the soonest agent that needs the item runs, over every
    workflow. Items no planned agent needs: the lowest priority. ``item.agents`` names agents as 'workflow/agent' or, when the name
    is unique across workflows, 'agent'."""

    name = "workflow"

    def __init__(self, workflows: Iterable[Workflow | Mapping] = ()):
        self.workflows: dict[str, Workflow] = {}
        if isinstance(workflows, (str, bytes, Mapping)):
            raise ValueError(f"workflows must be a list of workflows, got {workflows!r}")
        for w in workflows:
            self.add(Workflow.from_spec(w))

    def add(self, workflow: Workflow) -> None:
        if workflow.name in self.workflows:
            raise ValueError(f"workflow {workflow.name!r} is already planned")
        self.workflows[workflow.name] = workflow

    def ran(self, agent: str) -> bool:
        """Record that ``agent`` ('workflow/agent', or a name unique across workflows) just ran:
        the workflow whose current step it is advances. False if it was no workflow's current step
        (an agent outside the plan, or one running out of order)."""
        if not isinstance(agent, str):
            raise TypeError(f"agent must be a str, got {type(agent).__name__}")
        wf_name, _, local = agent.rpartition("/")
        flows = [self.workflows[wf_name]] if wf_name in self.workflows else list(self.workflows.values())
        for wf in flows:
            if wf.current == (local if wf_name in self.workflows else agent):
                wf.advance()
                return True
        return False

    def steps_to_execution(self, agents: Iterable[str]) -> float:
        best = NEVER
        for agent in agents:
            wf_name, _, local = agent.rpartition("/")
            flows = [self.workflows[wf_name]] if wf_name in self.workflows else self.workflows.values()
            for wf in flows:
                best = min(best, wf.steps_until(local if wf_name else agent))
        return best

    def priority(self, item: ItemState, now: int) -> int:
        steps = self.steps_to_execution(item.agents)
        return PRIORITY_MIN if steps == NEVER else clamp_priority(-steps)

    def prefetch(self, items: Iterable[ItemState], horizon: int = 2) -> list[Hashable]:
        """Keys of the items the agents of the next ``horizon`` steps need that do not run now,
        soonest first: what to bring up a tier before their turn."""
        check_int("horizon", horizon, 1)

        def soon(item):
            return self.steps_to_execution(item.agents)

        wanted = [i for i in items if 0 < soon(i) < horizon + 1]
        return [i.key for i in sorted(wanted, key=lambda i: (soon(i), str(i.key)))]

    def __repr__(self) -> str:
        return f"WorkflowAwarePolicy({sorted(self.workflows)})"


__all__ = ["NEVER", "Workflow", "WorkflowAwarePolicy"]
