"""A small language model with two attention blocks, trained a few steps eagerly and under
torch.compile(model) (inductor on the GPU, its compile workers as they start by default), in a
fresh process: tests/spine/test_gpu_compile.py runs it. Prints one JSON line: the losses of both.

    python3 tests/spine/compiled_model_probe.py [--steps 3] [--mode reduce-overhead] [--all-families]

Each block has a SimplicialAttention layer; with --all-families a causal SphericalAttention and
a causal TripleAttention layer too. --mode: torch.compile's (reduce-overhead: CUDA graphs).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import altattn  # noqa: E402

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, W1, W2 = 512, 256, 16, 1, 64, 8, 32


class Block(nn.Module):
    def __init__(self, all_families: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn = nn.ModuleList([altattn.SimplicialAttention(DIM, HEADS, KV_HEADS, HEAD_DIM,
                                                               W1, W2)])
        if all_families:
            self.attn.append(altattn.SphericalAttention(DIM, 4, 2, HEAD_DIM, causal=True))
            self.attn.append(altattn.TripleAttention(DIM, 4, HEAD_DIM, causal=True, scale=0.05,
                                                     normalize=True))
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + sum(attn(h) for attn in self.attn)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, all_families: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(all_families), Block(all_families))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def losses(model: nn.Module, tokens: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", default=None, help="torch.compile's mode")
    p.add_argument("--all-families", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyLM(args.all_families).cuda().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, VOCAB, (2, 257), device="cuda")
    eager = losses(model, tokens, args.steps)
    compiled = losses(torch.compile(twin, mode=args.mode), tokens, args.steps)
    from torch._dynamo.utils import counters
    from torch._inductor.compile_worker import subproc_pool
    print(json.dumps({"eager": eager, "compiled": compiled,
                      "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                      "spawn_workers": getattr(subproc_pool.SubprocPool, "_altattn_spawn", False),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
