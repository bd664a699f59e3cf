"""Stage 6, verify: checks on the final traces that fail loudly instead of hanging or computing garbage.

- :mod:`~fsdp_pass.verify.collective_lifetimes`: takes a final trace; raises if a collective's buffers are
  used while it is in flight;
- :mod:`~fsdp_pass.verify.same_collectives_on_all_ranks`: takes a final trace and the group; raises on every
  rank if any rank would issue different collectives.
"""
