"""The memory plan of the settings (engine/plan) and the start-up check that refuses one that does not fit.

    plan_inputs(settings, gpu_memory)   what ``flashtier plan`` and the check plan: the checkpoint's headers
                                        (MODEL_DIR) or the preset's geometry, serve's engine / KV / split settings
    check_memory_plan(settings)         SettingsError (one line, exit 2) when a rank's GPU or the host cannot
                                        hold the plan; run by ``preflight`` before anything loads, off the
                                        event loop (``serve`` starts uvicorn only after it)

The cards are measured with ``torch.cuda.get_device_properties`` (total bytes of cuda:0 .. cuda:N-1; no memory
is allocated), the host with /proc/meminfo's MemAvailable. On the CPU only the host is checked.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flashtier.server.config.settings import ServerSettings

if TYPE_CHECKING:
    from flashtier.engine.plan.memory_plan import MemoryPlan, PlanInputs, PlanMisfit

__all__ = ["check_memory_plan", "gpu_memory", "host_available", "plan_inputs", "plan_settings"]


def host_available() -> int | None:
    """Bytes of memory the host can hand out now (MemAvailable), None when /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_memory(settings: ServerSettings) -> tuple[int, ...]:
    """Total bytes of each rank's card (cuda:r for rank r; cuda:N for a one-rank --device cuda:N); () off CUDA."""
    device = settings.engine_config().device
    if not device.startswith("cuda"):
        return ()
    import torch

    count = torch.cuda.device_count()
    first = torch.device(device).index or 0
    ranks = range(first, first + settings.tensor_parallel_size)
    return tuple(torch.cuda.get_device_properties(i).total_memory for i in ranks if i < count)


def plan_settings(settings: ServerSettings, planned_gpu: int | None) -> ServerSettings:
    """``settings`` as ``flashtier plan`` reads them: a card size given (--gpu-memory) means a CUDA plan."""
    if planned_gpu is not None and settings.device is None:
        return dataclasses.replace(settings, device="cuda")
    return settings


def plan_inputs(settings: ServerSettings, card: int | None) -> PlanInputs:
    """The plan's inputs for ``settings``; ``card``: bytes of each GPU (sizes an automatic KV pool).

    Raises ValueError (CheckpointError) for an unreadable MODEL_DIR."""
    from flashtier.engine.model.config import preset
    from flashtier.engine.plan.inventory import inventory_from_checkpoint, inventory_from_config
    from flashtier.engine.plan.memory_plan import PlanInputs

    dspark = settings.speculative > 0  # the drafter's stages are loaded only with speculation on
    if settings.model_dir is not None:
        inventory = inventory_from_checkpoint(settings.model_dir, with_dspark=dspark)
    else:
        inventory = inventory_from_config(preset(settings.effective_preset or "tiny"), with_dspark=dspark)
    return PlanInputs(inventory, settings.engine_config(), settings.kvstore, settings.parallel_config(),
                      gpu_memory=card, tiers=settings.tensor_parallel_size == 1)


def evaluate(settings: ServerSettings, cards: tuple[int, ...], host: int | None
             ) -> tuple[MemoryPlan, PlanInputs, PlanMisfit | None]:
    """The plan of ``settings`` against ``cards`` (bytes per rank's GPU; () = unchecked) and ``host`` bytes."""
    from flashtier.engine.plan.memory_plan import build_plan, check_fit

    inputs = plan_inputs(settings, min(cards) if cards else None)
    plan = build_plan(inputs)
    return plan, inputs, check_fit(plan, inputs, gpu_memory=cards, host_memory=host)


def check_memory_plan(settings: ServerSettings) -> None:
    """SettingsError naming the flag to change when the plan does not fit this machine's GPUs or host memory."""
    from flashtier.server.config.checks import SettingsError

    _, _, misfit = evaluate(settings, gpu_memory(settings), host_available())
    if misfit is not None:
        raise SettingsError(misfit.flag, misfit.value, misfit.problem, misfit.fix)
