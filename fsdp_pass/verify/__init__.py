"""Stage 6, verify: checks that fail loudly instead of hanging or computing garbage.

- :mod:`~fsdp_pass.verify.collective_lifetimes`: takes a final trace; raises if a collective's buffers are
  used while it is in flight;
- :mod:`~fsdp_pass.verify.same_collectives_on_all_ranks`: keeps each compile's collective sequence and puts in
  the forward a per-step check that every rank's step issues the same ones (raises on every rank if not, before
  any mismatched collective), run beside the step's first collective by
  :mod:`~fsdp_pass.verify.step_agreement`;
- :mod:`~fsdp_pass.verify.ranks_arrive`: what each collective helper (state dicts, checkpoints) calls first:
  every rank arrives within the timeout, or the ranks that did raise, naming the ones that did not.
"""
