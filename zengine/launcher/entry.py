"""The per-process shim that ``torch.distributed.run`` starts for each rank.

Started as ``python -u -m zengine.launcher.entry TARGET [ARGS...]``. It runs
the user's ``TARGET`` as ``__main__`` in this same interpreter, so tracebacks
point at the user's code and ``if __name__ == "__main__":`` blocks run.

``TARGET`` is a script path, or a module name when the launcher sets
``ZENGINE_RUN_MODULE=1``. Unless the launcher sets ``ZENGINE_NO_LOCAL_RANK=1``,
``--local_rank=<LOCAL_RANK>`` is passed to the target right after its name,
where DeepSpeed's launcher puts it; ``ARGS`` follow untouched. With
``ZENGINE_DEEPSPEED_COMPAT=1`` (``zengine --deepspeed_compat``) ``import
deepspeed`` resolves to zengine first (``zengine/compat.py``).
"""

from __future__ import annotations

import os
import runpy
import sys

import json
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from .cores import bind_this_rank

COMPAT_ENV = "ZENGINE_DEEPSPEED_COMPAT"  # "1": `import deepspeed` is zengine (zengine/compat.py)
NO_LOCAL_RANK_ENV = "ZENGINE_NO_LOCAL_RANK"
RUN_MODULE_ENV = "ZENGINE_RUN_MODULE"


def target_argv(target: str, args: list[str], environ: dict[str, str]) -> list[str]:
    """The ``sys.argv`` the target sees: its name, ``--local_rank=N`` unless disabled, then ``args``."""
    if environ.get(NO_LOCAL_RANK_ENV) == "1":
        return [target, *args]
    return [target, f"--local_rank={environ.get('LOCAL_RANK', '0')}", *args]


class AtomicErrorHandler(ErrorHandler):
    """torch's per-rank error file, written whole or not at all.

    When one rank fails, its peers fail too (their collectives lose a peer) and the agent sends the
    survivors SIGTERM while they write their own error files; torch's handler writes in place, so the
    agent could read a half-written file and itself die of a JSONDecodeError instead of restarting
    the job (seen on an elastic run losing a node). Here the file appears by rename, complete."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        partial = f"{path}.{os.getpid()}.partial"
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)


def main(argv: list[str] | None = None) -> None:
    """Run the target named by ``argv[0]`` (default ``sys.argv[1:]``) as ``__main__``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m zengine.launcher.entry TARGET [ARGS...]")
    target, args = argv[0], argv[1:]
    sys.argv = target_argv(target, args, dict(os.environ))
    bind_this_rank(os.environ)  # zengine --bind_cores_to_rank: this rank's cores and threads
    if (
        os.environ.get(COMPAT_ENV) == "1"
    ):  # zengine --deepspeed_compat: `import deepspeed` is zengine
        from ..compat import install

        install()
    if os.environ.get(RUN_MODULE_ENV) == "1":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    # `python script.py` puts the script's folder first on sys.path; `-m` put
    # the working directory there instead, which stays behind it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")


# record() writes an uncaught exception to torchrun's per-rank error file, so
# the launcher's failure summary shows the user's traceback.
main = record(main, error_handler=AtomicErrorHandler())


if __name__ == "__main__":
    main()
