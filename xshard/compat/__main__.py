"""``python -m xshard.compat [-m module | script.py] [args...]``: runs a torch_xla script on xshard.

The ``torch_xla`` import hook is installed in this process only (and in the processes
``xmp.spawn`` starts from it), then the script runs as ``__main__`` with ``sys.argv`` set to
``[script, *args]`` and its directory first on ``sys.path``, as ``python script.py`` would.
The process joins a multi-process run first if one was set up (``python -m xshard.launch``,
torchrun); on its own it is one process.
"""

from __future__ import annotations

import os
import runpy
import sys

_USAGE = ("usage: python -m xshard.compat script.py [args...]  |  "
          "python -m xshard.compat -m module [args...]")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE + "\n\n" + (__doc__ or "").strip(), file=sys.stderr)
        return 0 if argv else 2
    if argv[0] == "-m":
        if len(argv) < 2:
            print(f"python -m xshard.compat -m needs a module name\n{_USAGE}", file=sys.stderr)
            return 2
        module, rest = argv[1], argv[2:]
        script = None
    else:
        script, rest = argv[0], argv[1:]
        if script.startswith("-"):
            print(f"unknown option {script!r}\n{_USAGE}", file=sys.stderr)
            return 2
        if not os.path.isfile(script):
            print(f"python -m xshard.compat: script {script!r} does not exist (working directory "
                  f"{os.getcwd()!r})", file=sys.stderr)
            return 2
    from xshard.compat import hook

    hook.install()
    import xshard

    xshard.initialize()  # joins a launched multi-process run; nothing in one process
    if script is not None:
        sys.argv[:] = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv[:] = [module, *rest]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
