"""Can ``torch.compile`` (inductor) build kernels here? Torch-free, so the CLI asks before a
local launch (``training.compile: true`` without a compiler is one ``error:`` line, exit 2) and
each rank asks again for its real device before compiling (``parallel/part/recompute.py``).

The choice documented in the README: a clear error, not a warning and an eager fallback — a
run the user asked to compile silently running slower is worse than one that does not start.
"""

from __future__ import annotations

import importlib.util
import os
import shutil


def compile_backend_problem(device_type: str) -> str | None:
    """Why inductor cannot build kernels for ``device_type``, or None when it can: on CPU it
    needs a C++ compiler (``$CXX`` when set, else g++/c++/clang++ on PATH); on CUDA, Triton
    (which builds its launchers with the same compiler)."""
    cxx = os.environ.get("CXX")
    if cxx:
        if not shutil.which(cxx):
            return f"$CXX={cxx} is not an executable C++ compiler, which inductor needs"
    elif not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH, which inductor needs"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed, which inductor needs on CUDA"
    if device_type not in ("cpu", "cuda"):
        return f"inductor has no backend for device type {device_type!r}"
    return None
