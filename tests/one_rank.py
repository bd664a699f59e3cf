"""A gloo process group of this process alone, for tests that run FSDP's collectives for real in the test
process (fake ones would leave garbage): ``with one_rank(): ...``."""

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
