"""The training loop around the step: clipping between ``backward()`` and ``optimizer.step()``, state dicts
and checkpoints between steps.

- :mod:`~fsdp_pass.train.grad_norm`: the gradient norm of the whole model from the shards (one
  all-reduce), clipping by it, and a per-unit table of norms to find where a NaN or an inf came from.
- :mod:`~fsdp_pass.train.state_dicts`: ``get_state_dict`` / ``set_state_dict`` of the model and its
  optimizers (torch's conventions and options; DTensor views of the shards, or full tensors), built on
  :mod:`~fsdp_pass.train.optimizer_state` (optimizer state by parameter name);
- :mod:`~fsdp_pass.train.distributed_checkpoint`: ``save_checkpoint`` / ``load_checkpoint``, folders of
  ``torch.distributed.checkpoint`` files, one per step, complete or absent, loadable at any world size; each
  checked before anything is loaded: its files against :mod:`~fsdp_pass.train.checkpoint_manifest` (the
  save's sequence, sizes, sha256), its keys and shapes against the model's
  (:mod:`~fsdp_pass.train.checkpoint_fit`), its loop state read without running code
  (:mod:`~fsdp_pass.train.loop_state`), each rank's extra by :mod:`~fsdp_pass.train.rank_extras`' rule. Rank 0's
  file work: :mod:`~fsdp_pass.train.checkpoint_folders` (names, the order of saves, leftovers) and
  :mod:`~fsdp_pass.train.checkpoint_publish` (the renames that publish, a rollback's checkpoints set aside,
  ``keep``).
"""
