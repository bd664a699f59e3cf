"""Stage 2, shard: put the plan into the module and the prologue.

- :mod:`~fsdp_pass.shard.mesh`: takes ``FSDP(process_group=..., mesh=...)``, gives the groups that shard and
  (HSDP) replicate;
- :mod:`~fsdp_pass.shard.module`: takes the ThunderModule, gives it this rank's dim-0 shards as parameters
  (once, when the transform is applied);
- :mod:`~fsdp_pass.shard.prologue`: takes the prologue trace, gives one that checks the shards' shapes;
- :mod:`~fsdp_pass.shard.global_view`: a shard seen as the whole parameter (a DTensor view, or gathered);
- :mod:`~fsdp_pass.shard.state_dict`: the model's state dict, sharded (DTensors) or full, out and in;
- :mod:`~fsdp_pass.shard.original`: the original module once sharded: calling it is refused, jitting it again
  starts from the shards;
- :mod:`~fsdp_pass.shard.requires_grad`: ``requires_grad`` changed after compiling: the plan follows it;
- :mod:`~fsdp_pass.shard.gloo_exit`: at exit, wait until the gloo groups' worker threads are idle (a rank aborted
  otherwise).
"""
