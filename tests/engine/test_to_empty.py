"""``engine/model/init.py``'s ``to_empty``: the meta model's tensors as uninitialised storage, exactly what
``nn.Module.to_empty`` gives (names, shapes, strides, dtypes, devices, parameters still parameters), without
the sympy import ``to_empty``'s meta ``empty_like`` costs every engine process a server starts (seconds)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.init import to_empty
from flashtier.engine.model.transformer import Transformer


def _meta():
    with torch.device("meta"):
        return Transformer(preset("tiny"), dtype=torch.bfloat16, with_dspark=True)


def _layout(model):
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [(n, tuple(t.shape), t.stride(), t.dtype, t.device, type(t)) for n, t in tensors]


def test_to_empty_gives_what_nn_module_to_empty_gives():
    ours, theirs = _layout(to_empty(_meta(), "cpu")), _layout(_meta().to_empty(device="cpu"))
    assert ours == theirs and len(ours) > 100
    assert {d for *_, d, _ in ours} == {torch.device("cpu")}


@pytest.mark.parametrize("call, imports_sympy", [("to_empty(m, 'cpu')", False), ("m.to_empty(device='cpu')", True)],
                         ids=["ours", "nn.Module (the check can see it)"])
def test_to_empty_imports_no_sympy(call, imports_sympy):
    code = ("import sys, torch\n"
            "from flashtier.engine.model.config import preset\n"
            "from flashtier.engine.model.init import to_empty\n"
            "from flashtier.engine.model.transformer import Transformer\n"
            "with torch.device('meta'):\n"
            "    m = Transformer(preset('tiny'), dtype=torch.float32, with_dspark=False)\n"
            f"m = {call}\n"
            "print('sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(imports_sympy), out.stderr
