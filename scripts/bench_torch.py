"""The PyTorch reference for gpt-tiny's CPU step: one process, or FSDP2 over ranks.

    .venv-interop/bin/python scripts/bench_torch.py              # one process
    .venv-interop/bin/python scripts/bench_torch.py --ranks 2    # FSDP2 (fully_shard), gloo

A plain PyTorch GPT of gpt-tiny's shape (4 blocks of width 192, 8 heads, MLP
768, learned positions, tied head, vocabulary 257), float32, AdamW, batch 32
x 128 random tokens: the figure zero_jax's CPU step is compared with
(scripts/anatomy.py, the README's step anatomy). Prints the median tokens/s
over --steps timed steps after --warmup. Needs torch (`make test-interop`
builds .venv-interop with it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def model(torch, vocab=257, layers=4, width=192, heads=8, mlp=768, positions=256):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.proj = nn.Linear(width, mlp), nn.Linear(mlp, width)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, heads, D // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, tokens):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.T

    return GPT()


def run(rank: int, ranks: int, args) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    net = model(torch)
    if ranks > 1:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=6e-4)
    rows = args.batch_size // ranks
    tokens = torch.randint(0, 257, (rows, args.seq_len + 1))
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        median = statistics.median(times)
        print(f"torch {torch.__version__}, {ranks} rank(s){' (FSDP2)' if ranks > 1 else ''}: "
              f"median step {median * 1e3:.1f} ms, {args.batch_size * args.seq_len / median:,.0f} "
              "tokens/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1, help="processes (FSDP2 when > 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="global rows (default 32)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    args = parser.parse_args(argv)
    try:
        import torch.multiprocessing as mp
    except ImportError:
        print("error: scripts/bench_torch.py needs torch: run it with .venv-interop/bin/python "
              "(make test-interop builds it)", file=sys.stderr)
        return 2
    if args.ranks < 1 or args.batch_size % args.ranks:
        print(f"error: --ranks {args.ranks} must be >= 1 and divide --batch-size "
              f"{args.batch_size}", file=sys.stderr)
        return 2
    if args.ranks == 1:
        run(0, 1, args)
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(run, args=(args.ranks, args), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
