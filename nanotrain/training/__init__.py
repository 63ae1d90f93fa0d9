"""The training step: gradient accumulation, gradient synchronisation, clipping, optimizer."""
