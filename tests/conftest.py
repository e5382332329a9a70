"""Shared pytest set-up: make tests/ importable (for the harness and models) in spawned ranks too."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The CPU suite computes on the CPU wherever it runs, a GPU host included (zengine would otherwise pick
# NCCL and cuda:LOCAL_RANK for a process started without a launcher). tests/cuda/ asks for CUDA itself.
os.environ.setdefault("ZENGINE_DEVICE", "cpu")
