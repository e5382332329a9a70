"""``zengine.runtime``: the members of ``deepspeed.runtime`` that training scripts import.

- ``runtime.dataloader.RepeatingLoader``: a data loader that starts over when it ends;
- ``runtime.utils.set_random_seed``, ``see_memory_usage``;
- ``runtime.base_optimizer.DeepSpeedOptimizer``, ``ZeROOptimizer``: the classes zengine's ZeRO
  optimizer derives from (its ``state_dict``; ``isinstance`` checks libraries make).
"""
