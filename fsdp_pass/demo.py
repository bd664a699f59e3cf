"""The main job: a short real training run under the pass, on CPU with gloo ranks.

    torchrun --standalone --nproc_per_node=2 -m fsdp_pass.demo --strategy zero3

1. Every rank builds the same small Llama-style model (seeded) and jits it with ``FSDP``.
2. Each rank trains on its own slice of every global batch (a toy language: count upwards mod V).
3. Rank 0 prints ``explain()`` (each unit's schedule, bytes per rank against the floor, predicted
   peak memory), the forward and backward traces, the overlap report (what compute runs while each
   collective is in flight), and the loss (averaged over ranks) at every step; it falls. At the end:
   the time per step spent blocked in waits, and one more forward + backward, measured (bytes handed
   to the process group, peak tensor memory) next to explain()'s prediction.
"""

from __future__ import annotations

import argparse
import os
import time

import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_pass_executors import WAIT_CLOCK, describe, executors_for

from fsdp_pass.api import fsdp_of, full_state_dict
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.report.measure import CollectiveBytes, allocated_during
from fsdp_pass.text import human_bytes
from fsdp_pass.transform import FSDP
from fsdp_pass.zoo import WithLoss


class Block(nn.Module):
    def __init__(self, d, n_head, hidden):
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=64, n_layer=2, n_head=4, hidden=128, block_size=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.layers = nn.ModuleList(Block(d, n_head, hidden) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def counting_batch(batch, seq, vocab, step):
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def measured_against_predicted(jm, x, y, device, repeats: int = 3) -> str:
    """More forward + backward passes, measured: bytes handed to the process group, peak tensor memory."""
    peaks, scratch = [], []
    for _ in range(repeats):
        jm.zero_grad(set_to_none=True)
        with CollectiveBytes() as sent:
            allocations = allocated_during(lambda: jm(x, y).backward(), device)
        peaks.append(allocations.peak_bytes)
        scratch.append(allocations.process_group_peak_bytes)
    jm.zero_grad(set_to_none=True)
    e = fsdp_of(jm).explain()
    return (
        f"{repeats} more forward + backward passes, measured on rank {dist.get_rank()} (predicted by explain()):\n"
        f"  bytes sent        {sent.bytes_sent_per_rank:,.0f} B  (predicted {e.bytes_per_rank:,.0f} B)\n"
        f"  step peak memory  {' / '.join(f'{p:,}' for p in peaks)} B  (predicted {e.memory.step.peak_bytes:,} B)\n"
        f"  (not counted: the process group's own scratch copies, up to {human_bytes(max(scratch))})"
    )


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3", choices=["zero2", "zero3"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (Schedule(prefetch=...))")
    parser.add_argument("--no-schedule", action="store_true", help="skip the scheduling pass (Thunder's order)")
    parser.add_argument("--no-traces", action="store_true", help="do not print the traces")
    return parser.parse_args(argv)


def _show_compile(jm, say, traces: bool) -> None:
    """After the first step: explain(), the traces, the overlap report."""
    fsdp = fsdp_of(jm)
    say(f"\n{fsdp.explain()}\n")
    if traces:
        say("=" * 30, "forward trace (rank 0)", "=" * 30)
        say(thunder.last_traces(jm)[-1])
        say("=" * 30, "backward trace (rank 0)", "=" * 30)
        say(thunder.last_backward_traces(jm)[-1])
    say("=" * 30, "overlap: what computes while each collective is in flight (rank 0)", "=" * 30)
    say(fsdp.overlap_report(), "\n")


def _train(jm, opt, args, device, say):
    """The training loop: a step per global batch, each rank on its slice. Returns the last batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step_times = []
    for step in range(args.steps):
        if step == 1:
            WAIT_CLOCK.reset()  # after the compile step
        x, y = counting_batch(args.batch_per_rank * world, 32, 64, step)
        x, y = (t[rank * args.batch_per_rank : (rank + 1) * args.batch_per_rank].to(device) for t in (x, y))
        t0 = time.perf_counter()
        loss = jm(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if step == 0:
            _show_compile(jm, say, traces=not args.no_traces)
        compile_note = ", includes compile" if step == 0 else ""
        say(f"step {step:3d}  loss {float(mean) / world:.4f}  ({step_times[-1] * 1000:.0f} ms{compile_note})")
    if args.steps > 1:
        timed = args.steps - 1
        say(
            f"\nafter the compile step: {sum(step_times[1:]) / timed * 1000:.1f} ms per step, of which "
            f"{WAIT_CLOCK.seconds / timed * 1000:.1f} ms blocked in collective waits (rank 0)"
        )
    return x, y


def main(argv=None):
    args = _arguments(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    world = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)

    torch.manual_seed(0)
    model = WithLoss(TinyLM(n_layer=args.layers)).to(device)  # the loss inside: the traces cover the step
    executors = executors_for(device)
    schedule = None if args.no_schedule else Schedule(prefetch=args.prefetch)
    jm = thunder.jit(model, transforms=[FSDP(args.strategy, schedule=schedule)], executors=executors)
    opt = torch.optim.AdamW(jm.parameters(), lr=3e-3)
    say(f"fsdp_pass demo: {args.strategy}, {world} ranks ({dist.get_backend()}), executors: {describe(executors)}")
    x, y = _train(jm, opt, args, device, say)

    say("\n" + measured_against_predicted(jm, x, y, device))
    full = full_state_dict(jm)
    local = sum(p.numel() for p in jm.parameters())
    say(f"\neach rank holds {local:,} of {sum(v.numel() for k, v in full.items() if 'weight' in k):,} parameter elements")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
