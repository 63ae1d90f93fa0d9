"""nanotrain: SLURM-native 3D-parallel LLM training, tested on CPU and a real SLURM cluster."""

__version__ = "0.1.0"

# The packages bottom up: each imports only those before it (tests/test_layering.py enforces it;
# scripts/import_graph.py and scripts/startup_path.py draw and count by it).
LAYERS = (
    "config",
    "parallel",
    "models",
    "data",
    "optim",
    "checkpoint",
    "hf",
    "logging",
    "training",
    "rehearse",
    "estimate",
    "runtime",
    "launch",
    "commands",
)
