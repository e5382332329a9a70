"""The ``zengine`` launcher: ``zengine [options] script.py [args]`` starts one
process per slot on one or several machines through ``torch.distributed.run``.

``hostfile`` parses hostfiles and ``--include``/``--exclude`` filters,
``runner`` plans and starts the launch, ``entry`` is the shim each rank runs,
and ``args`` holds ``add_config_arguments`` for training scripts.
"""
from zengine.launcher.args import add_config_arguments

__all__ = ["add_config_arguments"]
