"""Stage 1b, cost: what a plan costs. Takes a functional forward trace and a plan, gives predicted bytes, FLOPs,
step time and peak; nothing here chooses.

- :mod:`~fsdp_pass.cost.cost_model`: what a collective costs (latency and bandwidth, fitted to what
  :mod:`~fsdp_pass.cost.probe` measures) and the device's compute rate;
- :mod:`~fsdp_pass.cost.step_summary`: the trace cut into pieces (bytes, FLOPs, activations), tallied op by op
  by :mod:`~fsdp_pass.cost.op_tally` from :mod:`~fsdp_pass.cost.op_flops`, :mod:`~fsdp_pass.cost.saved_tensors`
  (what each op keeps for the backward) and :mod:`~fsdp_pass.cost.fused_saves`;
- :mod:`~fsdp_pass.cost.candidate_costs`: one candidate unit's own costs (its bytes, compute, collectives);
- :mod:`~fsdp_pass.cost.step_model`: a candidate plan's predicted step time and peak, from its units' costs;
- :mod:`~fsdp_pass.cost.price_plan`: the step model on any compiled plan, hand-written ones too
  (``fsdp_pass.predict_step``).
"""
