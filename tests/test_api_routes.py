"""Conversation affinity without a key (specsplit.api.routes): a prompt that begins with a whole
remembered prompt takes its routing group; nothing else shares one; the memory is bounded."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from brokers.rendezvous import ROUTE_SEP
from specsplit.api.routes import PromptRoutes


def test_a_conversations_next_turn_takes_its_group_and_a_sibling_does_not():
    routes = PromptRoutes(100)
    system = list(range(50))  # a system prompt every conversation shares
    turn1 = [*system, 7, 8, 9]
    g = routes.group_for(turn1)
    assert g and ROUTE_SEP not in g
    turn2 = [*turn1, 100, 101, 102, 103]  # the answer and the next question after the whole first turn
    assert routes.group_for(turn2) == g
    assert routes.group_for([*turn2, 5]) == g
    assert routes.group_for(turn1) == g  # the same prompt again (a retry, more choices)
    # the answer's text joined the prompt's last token (a newline) when the next turn was tokenized
    assert routes.group_for([*turn1[:-1], 55, 100, 101]) == g
    other = [*system, 7, 10, 9]  # shares the system prompt and more, but no whole earlier prompt
    assert routes.group_for(other) != g
    assert routes.group_for(system) not in (g, None)  # shorter than every remembered prompt: its own


def test_the_longest_remembered_prompt_wins():
    routes = PromptRoutes(100)
    long_first = routes.group_for([1, 2, 3, 4, 0])  # held as [1, 2, 3, 4]
    short_after = routes.group_for([1, 2, 0])  # held as [1, 2]; does not begin with [1, 2, 3, 4]
    assert short_after != long_first
    assert routes.group_for([1, 2, 3, 4, 5]) == long_first
    assert routes.group_for([1, 2, 9]) == short_after


def test_each_routing_is_counted():
    from specsplit.api.metrics import ApiMetrics

    metrics = ApiMetrics()
    routes = PromptRoutes(10, metrics.routed)
    routes.group_for([1, 2, 3])
    routes.group_for([1, 2, 3, 4])
    routes.group_for([5, 6])

    def count(route: str) -> float:
        return metrics.registry.get_sample_value("specsplit:prompt_routes_total", {"route": route})

    assert (count("continued"), count("new")) == (1.0, 2.0)


def test_off_and_empty_prompts_route_on_their_own():
    assert PromptRoutes(0).group_for([1, 2, 3]) is None
    assert PromptRoutes(10).group_for([]) is None


def test_memory_is_bounded_least_recently_used_first():
    routes = PromptRoutes(3)
    a = routes.group_for([1, 0])  # held as [1]
    b = routes.group_for([2, 2, 0])
    routes.group_for([3, 3, 3, 0])
    assert routes.group_for([1, 0, 0]) == a  # [1] used again; [1, 0] held too: [2, 2] is dropped
    assert len(routes) == 3
    assert routes.group_for([2, 2, 5]) != b
    assert len(routes) == 3 and routes._lengths == sorted(routes._count) and sum(routes._count.values()) == 3


class Model:
    """The rule by brute force: prompts in least-recently-used order, each with its group."""

    def __init__(self, cap: int) -> None:
        self.cap, self.held = cap, OrderedDict()

    def group_for(self, ids: tuple[int, ...], fresh: str) -> str:
        matches = [p for p in self.held if ids[:len(p)] == p]
        group = fresh
        if matches:
            best = max(matches, key=len)
            group = self.held[best]
            self.held.move_to_end(best)
        kept = ids[:-1] or ids
        self.held[kept] = group
        self.held.move_to_end(kept)
        while len(self.held) > self.cap:
            self.held.popitem(last=False)
        return group


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=40))
def test_groups_match_the_brute_force_rule(cap, prompts):
    routes, model = PromptRoutes(cap), Model(cap)
    names: dict[str, str] = {}  # the routes' fresh groups -> the model's
    for i, p in enumerate(prompts):
        got = routes.group_for(p)
        want = model.group_for(tuple(p), f"g{i}")
        if want == f"g{i}":  # a new group: never one handed out before
            assert got not in names
            names[got] = want
        assert names[got] == want
        assert len(routes) == len(model.held)
