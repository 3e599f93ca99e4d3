"""n > 1: one prompt, n choices. After the replay yields the first logits, the prompt's sequence is
forked: each child copies the parent's private state, shares its full blocks (one more reference each)
and gets a private copy of the partial tail block (it will be written by the child's own tokens).

    parent table  [ b0 b1 b2 | t ]        child table [ b0 b1 b2 | t' ]   b0..b2 ref += 1, t' = copy of t
"""

from __future__ import annotations

from flashtier.engine.kv.manager import KVManager
from flashtier.engine.core.request import Sequence


def fork(kvm: KVManager, parent: Sequence, child: Sequence) -> bool:
    """Make ``child`` (an empty sequence) continue exactly where ``parent`` is.

    Mutates: the pool (refs, one allocation), ``child.kv`` and ``child.hashes``.
    Failure: False when no block is free for the tail copy; nothing is held by the child then.
    """
    n_full = len(parent.kv.tokens) // kvm.block_size
    shared = parent.kv.table.ids[:n_full]
    ids = list(shared)
    if len(parent.kv.table) > n_full:  # the partial tail block is private: copy it
        tail = kvm.allocate(1)
        if tail is None:
            return False
        kvm.copy_block(parent.kv.table.ids[n_full], tail[0].block_id)
        ids.append(tail[0].block_id)
    kvm.pin(shared)
    child.kv.restore_private_state(parent.kv.private_state())
    child.kv.table.replace(ids)
    child.hashes = list(parent.hashes)
    child.fork_block = parent.fork_block
    return True
