"""A model fed token ids and labels as a Hugging Face causal LM is (``input_ids``, ``labels=``, its loss inside), and
the rank function of tests/test_input_checks.py that trains it from int32 ids."""

from __future__ import annotations

import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, full_state_dict

VOCAB = 37


class IdsToLoss(nn.Module):
    """An embedding, a linear head and the cross-entropy of ``labels``: the shape of an HF causal LM's call."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def ids(batch: int = 2, seq: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def int32_ids_train_as_int64() -> dict:
    """Two copies of the model, one fed int64 ids and one the same ids as int32 (labels int64 in both): their
    losses, gradients and weights after two SGD steps, as the largest difference."""
    rank = dist.get_rank()
    runs = {}
    for dtype in (torch.int64, torch.int32):
        torch.manual_seed(0)
        jm = thunder.jit(IdsToLoss(), transforms=[FSDP("zero3")], executors=executors_for("cpu"))
        opt = torch.optim.SGD(jm.parameters(), lr=0.5)
        losses = []
        for step in range(2):
            batch = ids(seed=10 * step + rank)
            loss = jm(batch.to(dtype), labels=batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        runs[dtype] = (losses, full_state_dict(jm))
    (losses64, weights64), (losses32, weights32) = runs[torch.int64], runs[torch.int32]
    torch.manual_seed(0)
    initial = IdsToLoss().state_dict()
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses64, losses32)),
        "weight_diff": max(float((weights64[k] - weights32[k]).abs().max()) for k in weights64),
        "trained": min(float((weights64[k] - initial[k]).abs().max()) for k in weights64),  # > 0: the steps moved
        # every weight, so equal weights are not two untouched copies
    }
