"""Build and install zengine.

Compiled kernels in ``csrc/`` are built just in time on first use; set
``ZENGINE_BUILD_OPS=1`` to build them ahead of time at install.
"""
from setuptools import find_packages, setup

setup(
    name="zengine",
    version="0.1.0",
    description="A ZeRO training engine for PyTorch (stages 0-3), drop-in for DeepSpeed's ZeRO",
    packages=find_packages(include=["zengine", "zengine.*"]),
    python_requires=">=3.9",
    # torch is pinned to a range that the local CPU build (2.13.0) satisfies, so
    # pip never pulls a multi-GB CUDA build on a machine that already has it.
    install_requires=[
        "torch>=2.4,<2.14",
        "pydantic>=2.0,<3",
        "psutil",
        "py-cpuinfo",
        "ninja",
    ],
    extras_require={"test": ["pytest"]},
    entry_points={
        "console_scripts": [
            "zengine=zengine.launcher.runner:main",
        ]
    },
)
