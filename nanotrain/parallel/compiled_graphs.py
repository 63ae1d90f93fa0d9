"""What ``torch.compile`` keeps of a compiled layer after the layer is gone, and how to let go of it.

Dynamo stores each graph it compiles as a global of the compiled function's module
(``__compiled_fn_<n>_<uuid>`` in ``nanotrain.models.llama``, for a decoder layer), and the graph
holds the objects it traced as constants: the tensor-parallel group of the column/row linears'
autograd functions among them. ``torch._dynamo.reset()`` empties the code caches but leaves those
globals, so a process group outlives its ``destroy`` and its C++ threads are torn down during
interpreter shutdown (the abort ``ParallelContext.destroy`` warns about). ``forget_compiled_graphs``
resets dynamo and drops the globals from nanotrain's modules; the next compile makes new ones.
"""

from __future__ import annotations

import sys

_PREFIXES = ("__compiled_fn", "__resume_at")  # dynamo's names for a graph and a graph break's rest


def forget_compiled_graphs() -> int:
    """Reset dynamo and drop its compiled graphs from nanotrain's modules; returns how many (0,
    and nothing touched, when nothing was ever compiled in this process)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return 0
    dropped = 0
    for name, module in list(sys.modules.items()):
        if name == "nanotrain" or name.startswith("nanotrain."):
            names = [k for k in vars(module) if k.startswith(_PREFIXES)]
            for k in names:
                delattr(module, k)
            dropped += len(names)
    if dropped:
        dynamo.reset()
    return dropped
