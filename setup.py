"""Build and install zengine.

Compiled kernels in ``csrc/`` are built just in time on first use; set
``ZENGINE_BUILD_OPS=1`` to build them ahead of time at install.
"""

import importlib.util
import os
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def compiled_ops():
    """(ext_modules, cmdclass): the ops declared in zengine/ops/ops.py when ZENGINE_BUILD_OPS=1,
    else nothing (they are then built just in time on first use). The build needs the installed
    torch: ``ZENGINE_BUILD_OPS=1 pip install --no-build-isolation .``"""
    if os.environ.get("ZENGINE_BUILD_OPS", "0") in ("", "0"):
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # ops.py imports only the standard library; load it without importing the zengine package.
    spec = importlib.util.spec_from_file_location(
        "zengine_op_specs", os.path.join("zengine", "ops", "ops.py")
    )
    specs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = specs  # dataclasses look their module up there
    spec.loader.exec_module(specs)
    extensions = [
        CppExtension(
            name=op.prebuilt_module,
            sources=[os.path.join("csrc", source) for source in op.sources],
            include_dirs=[
                os.path.abspath(os.path.join("csrc", folder)) for folder in op.include_dirs
            ],
            extra_compile_args=list(op.cflags),
            extra_link_args=list(op.ldflags),
        )
        for op in specs.ALL_OPS
    ]
    return extensions, {"build_ext": BuildExtension}


ext_modules, cmdclass = compiled_ops()

# One line that every Python process runs at start (site.py executes "import" lines of *.pth files in
# site-packages): it does nothing unless ZENGINE_DEEPSPEED_COMPAT is set, and then makes `import
# deepspeed` resolve to zengine in that process (zengine/compat.py), so that processes other tools
# start themselves (accelerate launch, the ranks Lightning spawns) get it too. Installed as a data
# file at site-packages' place under the prefix, the one way that holds for editable installs too.
COMPAT_PTH = "zengine-deepspeed-compat.pth"
# (by the install scheme, not this interpreter's paths: pip builds in an isolated environment)
SITE_PACKAGES = os.path.relpath(
    sysconfig.get_path("purelib", vars={"base": "/x", "platbase": "/x"}), "/x"
)


class BuildPyWithData(build_py):
    """build_py that, in an editable install, also installs the data files: setuptools' editable
    wheel asks the distribution for ``has_data`` (there is only ``has_data_files``) and so never
    installs them (setuptools 80-84), which would leave the compatibility hook out of ``pip install -e``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) and self.distribution.data_files:
            self.run_command("install_data")


setup(
    name="zengine",
    version="0.1.0",
    description="A ZeRO training engine for PyTorch (stages 0-3), drop-in for DeepSpeed's ZeRO",
    packages=find_packages(include=["zengine", "zengine.*"]),
    py_modules=["zengine_compat_hook"],  # read at start by COMPAT_PTH (below), outside the package
    python_requires=">=3.9",
    # torch is pinned to a range that the local CPU build (2.13.0) satisfies, so
    # pip never pulls a multi-GB CUDA build on a machine that already has it.
    install_requires=[
        "torch>=2.4,<2.14",
        "pydantic>=2.0,<3",
        # Config files are read with hjson, as DeepSpeed reads them (// and # comments, trailing
        # commas); a maintained parser rather than a hand-written one.
        "hjson>=3.0,<4",
        "psutil",
        "py-cpuinfo",
        "ninja",
        # torch's CPU wheels do not require numpy but warn at every import without it ("Failed to
        # initialize NumPy", once per process: three times in the quick start)
        "numpy",
    ],
    # transformers, accelerate, TRL, peft: the drop-in tests drive zengine through Hugging Face's
    # Trainer (LoRA adapters from peft), accelerate's DeepSpeedPlugin and TRL's SFT, DPO and GRPO
    # trainers on models built from a config (nothing downloaded);
    # none of them pins torch (peft asks torch>=1.13), so the pin above still decides which torch is
    # installed.
    # pytorch-lightning (with lightning_fabric): tests/lightning drive its Trainer and Fabric
    # DeepSpeedStrategy (it asks torch>=2.1, which the pin above meets).
    extras_require={
        "test": [
            "pytest",
            "transformers>=4.40",
            "accelerate>=1.0",
            "trl>=0.20",
            "peft>=0.13",
            "pytorch-lightning>=2.4",
            # the formatter tests/test_format.py checks the tree with; pinned, as another release may
            # lay the same code out differently
            "ruff==0.17.6",
        ],
        # benchmarks/bench_bf16_masters.py draws its loss curves with it (the rest need nothing more)
        "benchmarks": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "zengine=zengine.launcher.runner:main",
            "zengine-report=zengine.ops.report:main",
            "zengine-convert=zengine.checkpoint.export.convert:main",
            "zengine-to-fp32=zengine.checkpoint.export.to_fp32:main",
        ]
    },
    data_files=[(SITE_PACKAGES, [COMPAT_PTH])],
    ext_modules=ext_modules,
    cmdclass={**cmdclass, "build_py": BuildPyWithData},
)
