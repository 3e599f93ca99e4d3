"""The SSD restore path as it was before the restore buffer, kept as the oracle of the tests: blocks read
with ``SSDStore.get_many`` as bytes (the run ends at the first ``None``) and installed one block at a
time with ``KVManager.load_block`` (a bytes -> tensor conversion and a copy per block).

``use_bytes_path(monkeypatch)`` swaps both halves into a ``TierManager`` / ``install_resume``; the run
still travels as a ``RestoredRun`` (a copy of the bytes in plain memory), which the oracle install only
reads image by image.
"""

from __future__ import annotations

from flashtier.engine.tiers import resume
from flashtier.engine.kv.manager import KVManager
from flashtier.engine.tiers.restored_run import RestoredRun
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.block_hash import BlockHash


def bytes_prefix(ssd, keys: list[BlockHash]) -> tuple[bytes, ...]:
    """The old lookup's images: ``get_many`` up to the first miss."""
    images: list[bytes] = []
    for image in ssd.get_many(keys):
        if image is None:
            break
        images.append(image)
    return tuple(images)


def read_run_as_bytes(tiers: TierManager, keys: list[BlockHash]) -> RestoredRun:
    return RestoredRun.from_images(bytes_prefix(tiers.ssd, keys))


def load_run_from_bytes(kvm: KVManager, run: RestoredRun, block_ids: list[int], hashes: list[BlockHash],
                        tenant: bytes | None = None) -> None:
    """The old install: ``load_block`` per image, in order."""
    for j, (block_id, block_hash) in enumerate(zip(block_ids, hashes)):
        kvm.load_block(block_id, run.image(j), block_hash, tenant)
    run.release()


def use_bytes_path(monkeypatch) -> None:
    monkeypatch.setattr(TierManager, "_read_run", read_run_as_bytes)
    monkeypatch.setattr(resume, "load_run", load_run_from_bytes)
