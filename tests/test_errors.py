"""Bad input fails with a clear FSDPError that says what to do; never a hang."""

import sys

import pytest
import thunder
import torch
import torch.distributed as dist

from fsdp_pass import FSDP, FSDPError, fake_process_group
from tests import models, rank_cases


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(FSDPError, match="init_process_group"):
        thunder.jit(models.MLP(), transforms=[FSDP()])


def test_unknown_strategy_lists_every_name_fsdp_takes():
    with pytest.raises(FSDPError, match=r"Pass one of \['zero2', 'zero3', 'auto'\]"):
        FSDP("zero4")


def test_strategy_enum_and_names():
    from fsdp_pass import Strategy

    assert FSDP("ZeRO3").strategy is Strategy.ZERO3
    assert FSDP(Strategy.ZERO2).strategy is Strategy.ZERO2


def test_applied_twice():
    with fake_process_group(2):
        with pytest.raises(FSDPError, match="applied twice"):
            thunder.jit(models.MLP(), transforms=[FSDP(), FSDP()])


def test_dry_runs_leave_the_error_printer_as_they_found_it():
    # init_process_group wraps sys.excepthook to prefix "[rank0]: "; ten dry runs must not stack ten prefixes
    before = sys.excepthook
    for _ in range(2):
        with fake_process_group(2):
            assert sys.excepthook is not before  # torch's prefixing hook, while the group lives
    assert sys.excepthook is before


def test_thunder_fsdp_then_ours():
    with fake_process_group(2):
        model = models.MLP()
        model.use_fsdp = True  # what thunder.distributed.fsdp leaves on a model it sharded
        with pytest.raises(FSDPError, match="already sharded"):
            thunder.jit(model, transforms=[FSDP()])


def test_mixed_devices():
    model = models.MLP()
    model.head.weight = torch.nn.Parameter(torch.empty(4, 16, device="meta"))
    with fake_process_group(2):
        with pytest.raises(FSDPError, match="several devices"):
            thunder.jit(model, transforms=[FSDP()])


def test_meta_without_reset_parameters():
    class NoInit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, 4, device="meta"))

        def forward(self, x):
            return x @ self.w

    with fake_process_group(2):
        with pytest.raises(FSDPError, match="reset_parameters"):
            thunder.jit(NoInit(), transforms=[FSDP()])


def test_broadcast_from_out_of_range():
    with fake_process_group(2):
        with pytest.raises(FSDPError, match="broadcast_from=5"):
            thunder.jit(models.MLP(), transforms=[FSDP(broadcast_from=5)])


def test_model_without_parameters_just_works(ranks):
    assert ranks(2).run(rank_cases.no_parameters) == [True, True]
