"""Where the model states live when they are not all on the compute device.

- ``placement.py``: the placement objects, one per run, chosen from the config: device, CPU or
  NVMe for the fp32 masters, their gradients and the optimizer states;
- ``copies.py``: moving gradients down and parameters up between the device and host memory;
- ``arrivals.py``: gradient pieces still on their way down, settled range by range;
- ``landing.py``: where reduced gradient shards land (in memory, or ZeRO-Infinity's swap records)
  and the sums of squares of the regions they wrote;
- ``step_pipeline.py``: the offloaded step in pieces, as gradients land, each piece's parameters going
  up while CPU-Adam steps the next;
- ``state_swap.py`` + ``swapped_adam.py``: optimizer states in an NVMe swap file, stepped by
  CPU Adam as they stream through a few host buffers;
- ``param_swap.py``: stage-3 parameter shards in an NVMe swap file, read ahead of the gathers;
- ``masters.py``: the fp32 masters in memory and each step's master gradients (whole, in pieces);
- ``infinity.py``: ZeRO-Infinity's parts: its optimizer, master store (with the gradient sink) and
  the link between the swapped step and the parameter shards;
- ``pinned.py``: page-locked host buffers sized exactly (registered, not torch's power-of-two cache),
  and the count of pinned bytes held.

Layering: ``zero/`` uses this package; this package uses ``ops/`` and never imports ``zero/``.
"""
