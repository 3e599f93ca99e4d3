"""Run the tiny model on a CUDA device: incremental path vs oracle (float64 mode), Triton quantisers.

Usage: python -m flashtier... or `python benchmarks/model_smoke_cuda.py` with flashtier importable.
Prints one line per check and exits non-zero on a mismatch. Not a test (CI has no GPU).
"""

import sys
import time

import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model.init import random_model
from flashtier.engine.model.reference import Plan, reference_forward


def main() -> int:
    dev = torch.device("cuda")
    cfg = preset("tiny")
    model = random_model(cfg, seed=1, dtype=torch.float64, with_dspark=False).to(dev)
    model.token_map = model.token_map.to(dev)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 128000, (210,), generator=g).tolist()
    runner = IncrementalModel(model)
    t = time.perf_counter()
    tokens, logits = greedy_generate(runner, prompt, 100)
    gen_s = time.perf_counter() - t
    seq = torch.tensor(prompt + tokens[:-1], device=dev)
    ref = reference_forward(model, seq, Plan.ced(len(prompt), seq.numel(), cfg.sliding_window)).logits
    inc = torch.stack(logits)
    err = float((inc - ref).abs().max() / ref.abs().max())
    same = torch.argmax(ref, -1).tolist() == tokens
    print(f"cuda tiny fp64: 210 prompt + 100 decode in {gen_s:.1f}s; rel err {err:.2e}; greedy equal {same}")
    return 0 if (err <= 1e-4 and same) else 1


if __name__ == "__main__":
    sys.exit(main())
