"""Stage 2, shard: put the plan into the module and the prologue.

- :mod:`~fsdp_pass.shard.module`: takes the ThunderModule, gives it this rank's dim-0 shards as parameters
  (once, when the transform is applied);
- :mod:`~fsdp_pass.shard.prologue`: takes the prologue trace, gives one that checks the shards' shapes;
- :mod:`~fsdp_pass.shard.state_dict`: full state dicts in and out of the sharded module.
"""
