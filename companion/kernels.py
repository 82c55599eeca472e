"""CPU kernels pinned to one instruction-set level, so a stage gives the same bytes on any x86-64 processor.

PyTorch, MKL and oneDNN choose their kernels (AVX-512, AVX2, ...) when they load, from the processor; two
processors with other vector units round differently, and training amplifies that (a fine-tune on AVX-512
kernels and the same fine-tune on AVX2 kernels end with other weights: see
:mod:`companion.experiments.language_zoo`). The environment :data:`KERNEL_ENV` fixes the level; it is read
when the libraries load, so it must be in the environment **before** the process imports torch. Hence:

* a command-line stage calls :func:`reexec` first: if the environment is not the pinned one, the process
  restarts itself (``os.execve``) with it, once (a second time it raises with what is wrong);
* a notebook stage runs under ``python -m companion.kernels STAGE -- python -m companion.pipeline STAGE``
  (:func:`main`): the pipeline, and the notebook kernel it starts, inherit the environment of the stage's
  ``cpu_kernels``, and the notebook's code calls :func:`check`;
* the code that computes a stage's numbers calls :func:`check` (also inside worker processes, which inherit the
  environment), so an unpinned run is refused rather than silently giving other bytes.

The language zoos pin their training the same way (``cpu_kernels`` of ``language_train`` and
``minilm_train``; :data:`KERNEL_ENV` is theirs, a test keeps the two equal). This module imports nothing
heavy, so a command can call :func:`reexec` before torch is imported.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping

#: Environment that pins the CPU kernels to one level on any x86-64 processor that has it: PyTorch's own
#: kernels, MKL's BLAS with conditional numerical reproducibility, oneDNN.
KERNEL_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
#: Set in the environment of a process restarted by :func:`reexec` (so a restart happens once).
REEXEC_FLAG = "HIDESEEK_KERNEL_REEXEC"


def validate(level: str | None) -> str | None:
    """``level`` lower-cased if it is ``None`` or a key of :data:`KERNEL_ENV`; else a one-line error."""
    if level is None:
        return None
    if str(level).lower() not in KERNEL_ENV:
        raise ValueError(f"cpu_kernels must be null or one of {sorted(KERNEL_ENV)}, got {level!r}")
    return str(level).lower()


def pinned(level: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default: this process's) holds the environment of ``level`` (``None``: always)."""
    level = validate(level)
    env = os.environ if environ is None else environ
    return level is None or all(env.get(k) == v for k, v in KERNEL_ENV[level].items())


def cpu_kernels() -> dict[str, Any]:
    """The kernel level torch runs (``torch.backends.cpu.get_cpu_capability()``) and the variables of
    :data:`KERNEL_ENV` as set in this process: what a bitwise comparison must match."""
    import torch

    names = sorted({k for env in KERNEL_ENV.values() for k in env})
    return {"capability": torch.backends.cpu.get_cpu_capability(), **{k: os.environ.get(k) for k in names}}


def check(level: str | None, what: str = "this stage") -> dict[str, Any] | None:
    """Raise unless torch runs the kernels of ``level`` with its environment set; return :func:`cpu_kernels`.

    ``None``: nothing is checked (the processor's own kernels) and ``None`` is returned.
    """
    level = validate(level)
    if level is None:
        return None
    have = cpu_kernels()
    bad = {k: have[k] for k, v in KERNEL_ENV[level].items() if have[k] != v}
    if bad or have["capability"].lower() != level:
        env = " ".join(f"{k}={v}" for k, v in KERNEL_ENV[level].items())
        raise RuntimeError(f"{what}: cpu_kernels={level!r} but torch runs {have['capability']} kernels with "
                           f"{bad or 'its environment'}; start Python with `{env}` (the stage's command does it "
                           f"itself), or set cpu_kernels: null to run with this processor's own kernels")
    return have


def stage_env(level: str | None) -> dict[str, str]:
    """The variables to put into a child process's environment for ``level`` (empty for ``None``)."""
    level = validate(level)
    return {} if level is None else dict(KERNEL_ENV[level])


def reexec(level: str | None, module: str, argv: list[str] | None = None) -> None:
    """Restart ``python -m module argv`` with the environment of ``level`` unless it is already set.

    Call it before the command imports torch (the kernels are chosen when it loads). A process that was
    already restarted once and still lacks the environment raises (:func:`check`'s message) instead of
    restarting again.
    """
    level = validate(level)
    if level is None or pinned(level):
        return
    if os.environ.get(REEXEC_FLAG):
        check(level, f"python -m {module}")
    env = KERNEL_ENV[level]
    print(f"cpu_kernels={level}: restarting with {env}", flush=True)
    args = list(sys.argv[1:]) if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, **env, REEXEC_FLAG: "1"})


def main(argv: list[str] | None = None) -> int:
    """``python -m companion.kernels STAGE -- COMMAND ...``: run COMMAND with the kernels of ``STAGE``'s
    ``cpu_kernels`` (its params.yaml section at the file's profile) pinned in its environment.

    For a notebook stage: ``python -m companion.kernels vision -- python -m companion.pipeline vision`` starts
    the pipeline, and so the notebook's kernel process, with :data:`KERNEL_ENV` already set (the notebook's code
    then checks it). ``cpu_kernels: null``: COMMAND runs with the environment unchanged.
    """
    import argparse

    args = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m companion.kernels", description=main.__doc__.split("\n")[0])
    ap.add_argument("stage")
    ap.add_argument("--params", default=None, help="parameter file (default: the repository's params.yaml)")
    if "--" not in args:
        ap.error("expected `STAGE -- COMMAND ...`")
    cut = args.index("--")
    ns = ap.parse_args(args[:cut])
    command = args[cut + 1:]
    if not command:
        ap.error("no COMMAND after `--`")
    from companion.params import ParamsError, stage_params

    try:
        _, params = stage_params(ns.stage, None, path=ns.params)
        level = validate(params.get("cpu_kernels"))
    except (ParamsError, ValueError) as exc:
        ap.error(str(exc))
    env = {**os.environ, **stage_env(level)}
    sys.stdout.flush()
    os.execvpe(command[0], command, env)
    return 0   # not reached


if __name__ == "__main__":
    sys.exit(main())
