"""FreeBlockQueue: LRU order, O(1) removal anywhere, membership, misuse errors, integrity under random ops."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.kvstore.free_queue import FreeBlockQueue


class Node:
    __slots__ = ("id", "prev_free", "next_free")

    def __init__(self, i):
        self.id = i
        self.prev_free = None
        self.next_free = None

    def __repr__(self):
        return f"Node({self.id})"


def make(n):
    nodes = [Node(i) for i in range(n)]
    return nodes, FreeBlockQueue(nodes)


def ids(q):
    return [node.id for node in q]


def test_initial_order_and_popleft_is_lru():
    nodes, q = make(4)
    assert len(q) == 4 and ids(q) == [0, 1, 2, 3]
    assert q.peek() is nodes[0]
    assert q.popleft() is nodes[0]
    q.append(nodes[0])  # freed most recently -> evicted last
    assert ids(q) == [1, 2, 3, 0]
    assert [n.id for n in q.popleft_n(2)] == [1, 2]
    assert ids(q) == [3, 0] and len(q) == 2


@pytest.mark.parametrize("victim, rest", [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]), (4, [0, 1, 2, 3])])
def test_remove_front_middle_back(victim, rest):
    nodes, q = make(5)
    q.remove(nodes[victim])
    assert ids(q) == rest and len(q) == 4
    assert not FreeBlockQueue.is_queued(nodes[victim])
    assert nodes[victim].prev_free is None and nodes[victim].next_free is None
    q.check_integrity()


def test_membership_and_empty_queue():
    nodes, q = make(2)
    assert all(FreeBlockQueue.is_queued(n) for n in nodes)
    q.popleft_n(2)
    assert len(q) == 0 and ids(q) == [] and q.peek() is None
    assert not any(FreeBlockQueue.is_queued(n) for n in nodes)
    with pytest.raises(IndexError):
        q.popleft()
    q.check_integrity()


def test_misuse_raises_and_changes_nothing():
    nodes, q = make(3)
    with pytest.raises(ValueError, match="already in a free queue"):
        q.append(nodes[1])
    with pytest.raises(IndexError):
        q.popleft_n(4)
    with pytest.raises(IndexError):
        q.popleft_n(-1)
    q.remove(nodes[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(nodes[1])
    assert ids(q) == [0, 2]
    q.check_integrity()


def test_check_integrity_catches_broken_links():
    nodes, q = make(4)
    nodes[2].prev_free = nodes[0]  # back link skips node 1
    with pytest.raises(RuntimeError, match="does not point back"):
        q.check_integrity()

    nodes, q = make(4)
    q._len = 3  # stale length
    with pytest.raises(RuntimeError, match="len"):
        q.check_integrity()

    nodes, q = make(4)
    nodes[3].next_free = nodes[1]  # cycle 1 -> 2 -> 3 -> 1: the walk must stop, not spin
    nodes[1].prev_free = nodes[3]
    with pytest.raises(RuntimeError, match="does not point back|cycle"):
        q.check_integrity()

    nodes, q = make(3)
    nodes[1].next_free = None
    with pytest.raises(RuntimeError, match="hit None"):
        q.check_integrity()


ops_st = st.lists(st.tuples(st.sampled_from(["pop", "append", "remove", "pop_n"]), st.integers(0, 63)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 12), ops=ops_st)
def test_random_ops_match_a_list_model(n, ops):
    """Every op sequence keeps the queue equal to a plain-list model and passes check_integrity."""
    nodes, q = make(n)
    model = list(nodes)
    for op, k in ops:
        if op == "pop":
            if model:
                assert q.popleft() is model.pop(0)
            else:
                with pytest.raises(IndexError):
                    q.popleft()
        elif op == "pop_n":
            m = k % (len(model) + 1)
            popped = q.popleft_n(m)
            assert popped == model[:m]
            del model[:m]
        elif op == "append":
            outside = [x for x in nodes if x not in model]
            if outside:
                node = outside[k % len(outside)]
                q.append(node)
                model.append(node)
        elif op == "remove" and model:
            node = model.pop(k % len(model))
            q.remove(node)
        q.check_integrity()
        assert len(q) == len(model) and list(q) == model
        assert all(FreeBlockQueue.is_queued(x) == (x in model) for x in nodes)
