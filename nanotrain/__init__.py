"""nanotrain: SLURM-native 3D-parallel LLM training, tested on CPU and a real SLURM cluster."""

__version__ = "0.1.0"
