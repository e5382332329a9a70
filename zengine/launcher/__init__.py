"""The ``zengine`` launcher: ``zengine [options] script.py [args]`` starts one
process per slot on one or several machines through ``torch.distributed.run``.

``options`` parses and checks the command's options, ``hostfile`` parses
hostfiles and ``--include``/``--exclude`` filters, ``plan`` decides the hosts,
slots and torchrun arguments, ``rendezvous`` how the nodes meet, ``environment``
the variables workers get, ``remote`` the ssh/pdsh commands for other hosts,
``runner`` runs the plan (the ``zengine`` console script), ``entry`` is the
shim each rank runs, and ``args`` holds ``add_config_arguments`` for training scripts.
"""

from zengine.launcher.args import add_config_arguments

__all__ = ["add_config_arguments"]
