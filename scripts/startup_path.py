#!/usr/bin/env python
"""Follow the config through one rank's start-up and count the walk: stops, modules, climbs, returns.

    python scripts/startup_path.py                     # configs/tiny_cpu.yaml, one process
    python scripts/startup_path.py CONFIG --depth 2    # the path (and counts) two stops deep

Why: a rank's start-up should read top to bottom, each module visited once where it can. This
measures it on a real run instead of arguing from the source: a one-process local run of the
config (every parallel size 1, one train step, logs and token cache in a fresh temporary
directory), traced with ``sys.setprofile`` on the main thread from the call of
``nanotrain.runtime.task.run_task`` until ``nanotrain.training.step.train_step`` is first called.
The run is re-executed with PYTHONHASHSEED=0, so the same code prints the same path every time.

What is counted (the path is the list of stops in the order they are called):

  stop     a call of a function defined in a nanotrain source file that receives, as one of its
           parameters (``self`` included), a *config-carrying* object: an instance of a dataclass
           of ``nanotrain.config.schema`` (the Config, a section such as ``config.model``, or a
           sub-section), or an object *built from* one: the ``self`` of an ``__init__`` that is a
           stop, or an instance of a nanotrain class returned by a stop (also inside a returned
           tuple, list or dict, one level deep). Not stops: module bodies and everything they call
           (imports), lambdas and comprehensions, property accessors and dunder methods other than
           ``__init__`` / ``__call__`` / ``__post_init__`` (they read like attributes and
           operators). The entry, ``run_task``, is always the first stop.
  module   a module holding at least one stop; ``modules`` counts the distinct ones.
  caller   the module of the nearest nanotrain frame below a stop (stop or not).
  visit    a maximal run of consecutive stops in one module.
  return   a visit entered from another module (its first stop's caller is not its own module)
           to a module that an earlier visit already left: the reader goes back to a module it
           has read. Two calls in a row into one module are one visit; a function's call of a
           helper in its own module is never a return.
  climb    a stop whose caller lives in a package lower in
           the layering than the stop's own: ``tests/test_layering.py``'s order config, parallel,
           models, data, optim, checkpoint, hf, logging, training, rehearse, estimate, runtime,
           launch, commands. Imports only point down, so a climb is a call through a callable or
           an object handed down (a callback).

The printed path is one line per visit: its depth (stops above its first), the module, and its
functions, ``name xN`` for N calls in a row; ``<`` marks a return, ``^`` names a climb's caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanotrain import LAYERS as ORDER  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer, non_negative_int  # noqa: E402

PACKAGE = str(ROOT / "nanotrain") + os.sep
ENTRY = ("nanotrain.runtime.task", "run_task")
FIRST_STEP = ("nanotrain.training.step", "train_step")
KEPT_DUNDERS = ("__init__", "__call__", "__post_init__")
ONE_PROCESS = (
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "parallelism.cp=1",
    "parallelism.ep=1",
    "training.train_steps=1",
    "logging.run_name=startup",
)
# What an outer launcher sets would change the launcher `runtime/env.py` detects.
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NANOTRAIN_LAUNCHER",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
)


def module_of(filename: str) -> str | None:
    """``nanotrain.x.y`` for a file of the package, else None."""
    if not filename.startswith(PACKAGE):
        return None
    parts = Path(filename).relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    return ORDER.index(parts[1]) if len(parts) > 1 and parts[1] in ORDER else -1


@dataclasses.dataclass
class Stop:
    module: str
    name: str
    depth: int
    caller: str | None  # the nearest nanotrain frame's module below it (None: the entry)

    @property
    def climb(self) -> bool:
        return self.caller is not None and layer(self.caller) < layer(self.module)


class Tracer:
    """The ``sys.setprofile`` function that records the stops (see the module docstring)."""

    def __init__(self, schema_types: tuple[type, ...]):
        self.schema_types = schema_types
        self.stops: list[Stop] = []
        self.built: dict[int, object] = {}  # id -> object built from the config (held: ids stay unique)
        self.stack: list[tuple[object, str | None, bool]] = []  # (frame, its nanotrain module, is a stop)
        self.importing = 0  # module bodies being executed (imports): nothing under them counts
        self.done = False
        self._accessor: dict[object, bool] = {}

    def __call__(self, frame, event: str, arg) -> None:
        if event == "call":
            self._call(frame)
        elif event == "return":
            self._return(frame, arg)

    def _call(self, frame) -> None:
        code = frame.f_code
        if code.co_name == "<module>":
            self.importing += 1
            self.stack.append((frame, None, False))
            return
        module = None if self.importing else module_of(code.co_filename)
        if module is not None and (module, code.co_name) == FIRST_STEP:
            self.done = True
            sys.setprofile(None)
            # What the tracer held (frames, built objects) must not keep a process group alive
            # when the run destroys them at its end.
            self.stack.clear()
            self.built.clear()
            return
        stop = module is not None and self._is_stop(frame, module)
        if stop:
            caller = next((m for _, m, _ in reversed(self.stack) if m is not None), None)
            depth = sum(1 for _, _, s in self.stack if s)
            self.stops.append(Stop(module, getattr(code, "co_qualname", code.co_name), depth, caller))  # 3.11+
            if code.co_name == "__init__":
                self._keep(frame.f_locals.get("self"))
        self.stack.append((frame, module, stop))

    def _return(self, frame, value) -> None:
        if not any(top is frame for top, _, _ in self.stack):
            return  # a frame entered before the tracer was installed
        while self.stack:
            top, _, stop = self.stack.pop()
            if top.f_code.co_name == "<module>":
                self.importing -= 1
            if top is frame:
                if stop:
                    self._keep_returned(value)
                return

    def _is_stop(self, frame, module: str) -> bool:
        code = frame.f_code
        if not self.stops:
            return (module, code.co_name) == ENTRY
        name = code.co_name
        if name.startswith("<") or (name.startswith("__") and name.endswith("__") and name not in KEPT_DUNDERS):
            return False
        values = self._arguments(frame)
        if values and code.co_varnames[0] == "self" and self._is_accessor(code, values[0]):
            return False
        return any(self._carries(v) for v in values)

    @staticmethod
    def _arguments(frame) -> list:
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
        local = frame.f_locals
        values = []
        for name in code.co_varnames[:count]:
            value = local.get(name)
            if isinstance(value, tuple) and name not in code.co_varnames[: code.co_argcount]:
                values.extend(value)
            elif isinstance(value, dict) and name not in code.co_varnames[: code.co_argcount]:
                values.extend(value.values())
            else:
                values.append(value)
        return values

    def _is_accessor(self, code, obj) -> bool:
        """Is ``code`` a property's (or cached_property's) function on ``obj``'s class?"""
        key = (code, type(obj))
        if key not in self._accessor:
            found = False
            for klass in type(obj).__mro__:
                for attr in vars(klass).values():
                    funcs = (
                        (attr.fget, attr.fset, attr.fdel)
                        if isinstance(attr, property)
                        else ((attr.func,) if isinstance(attr, functools.cached_property) else ())
                    )
                    found = found or any(getattr(f, "__code__", None) is code for f in funcs)
            self._accessor[key] = found
        return self._accessor[key]

    def _carries(self, value) -> bool:
        return isinstance(value, self.schema_types) or (id(value) in self.built and self.built[id(value)] is value)

    def _keep(self, value) -> None:
        if value is not None and type(value).__module__.startswith("nanotrain.") and not isinstance(value, type):
            self.built[id(value)] = value

    def _keep_returned(self, value) -> None:
        items = (
            list(value.values())
            if isinstance(value, dict)
            else (list(value) if isinstance(value, (tuple, list)) else [value])
        )
        for item in [value, *items]:
            self._keep(item)


def visits(stops: list[Stop]) -> list[list[Stop]]:
    out: list[list[Stop]] = []
    for stop in stops:
        if out and out[-1][0].module == stop.module:
            out[-1].append(stop)
        else:
            out.append([stop])
    return out


def returns(path: list[list[Stop]]) -> list[bool]:
    """Whether each visit of ``path`` is a return (see the module docstring)."""
    seen: set[str] = set()
    out = []
    for visit in path:
        first = visit[0]
        out.append(first.caller not in (None, first.module) and first.module in seen)
        seen.add(first.module)
    return out


def counts(stops: list[Stop]) -> dict[str, int]:
    return {
        "stops": len(stops),
        "modules": len({s.module for s in stops}),
        "climbs": sum(s.climb for s in stops),
        "returns": sum(returns(visits(stops))),
    }


def describe(visit: list[Stop]) -> str:
    names: list[list] = []
    for stop in visit:
        if names and names[-1][0] == stop.name:
            names[-1][1] += 1
        else:
            names.append([stop.name, 1])
    text = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in names)
    climbs = sorted({s.caller for s in visit if s.climb})
    return text + "".join(f"  ^ climb from {c}" for c in climbs)


def print_path(stops: list[Stop]) -> None:
    path = visits(stops)
    for visit, back in zip(path, returns(path)):
        first = visit[0]
        mark = "<" if back else " "
        print(f"{first.depth:3d} {mark} {'  ' * first.depth}{first.module}: {describe(visit)}")


def trace(config_arg: str, overrides: list[str]) -> list[Stop]:
    """Run one rank of ``config_arg`` (one process, one step) and return its stops."""
    from nanotrain.config import load_config, schema
    from nanotrain.config.loader import dump_config
    from nanotrain.runtime import task

    schema_types = tuple(
        v
        for v in vars(schema).values()
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == schema.__name__
    )
    with tempfile.TemporaryDirectory(prefix="nanotrain-startup-path-") as tmp:
        config = load_config(config_arg, [*overrides, *ONE_PROCESS, f"logging.dir={tmp}"])
        path = Path(tmp) / "config.yaml"
        dump_config(config, path)
        tracer = Tracer(schema_types)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                sys.setprofile(tracer)
                try:
                    task.run_task(str(path))
                finally:
                    sys.setprofile(None)
        except BaseException:
            sys.stderr.write(out.getvalue())
            raise
        stops = tracer.stops
        if not tracer.done:
            raise RuntimeError(f"the run ended before {'.'.join(FIRST_STEP)} was called:\n{out.getvalue()[-2000:]}")
    return stops


def main(argv: list[str] | None = None) -> int:
    return answer(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(prog="scripts/startup_path.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "config",
        nargs="?",
        default=str(ROOT / "configs" / "tiny_cpu.yaml"),
        help="YAML config (default: configs/tiny_cpu.yaml); run as one process, one step",
    )
    parser.add_argument(
        "--set",
        metavar="SECTION.FIELD=VALUE",
        action="append",
        default=[],
        help="override a config field, as submit.py's --set; repeatable",
    )
    parser.add_argument(
        "--depth",
        type=non_negative_int,
        metavar="D",
        help="only the stops at most D deep (the entry is 0): the path and its counts",
    )
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0" or any(v in os.environ for v in _LAUNCHER_VARS):
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        env.update(PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    stops = [s for s in trace(args.config, args.set) if args.depth is None or s.depth <= args.depth]
    print_path(stops)
    found = counts(stops)
    print(" ".join(f"{k} {v}" for k, v in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
