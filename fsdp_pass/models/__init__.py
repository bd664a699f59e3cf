"""Models to plan, dry-run and train with: the built-in zoo (:mod:`~fsdp_pass.models.zoo`), the main job's
small LM (:mod:`~fsdp_pass.models.tiny_lm`), Hugging Face causal LMs built from their config alone
(:mod:`~fsdp_pass.models.hf_config`; transformers 5's output capture under ``thunder.jit``:
:mod:`~fsdp_pass.models.hf_output_capture`), what ``--model`` names (:mod:`~fsdp_pass.models.spec`), and what keeps
Thunder's compiles of them from failing when a garbage collection runs in the middle
(:mod:`~fsdp_pass.models.thunder_gc_guard`)."""
