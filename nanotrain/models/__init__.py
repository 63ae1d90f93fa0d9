"""Models built from nanotrain's tensor-parallel layers."""
