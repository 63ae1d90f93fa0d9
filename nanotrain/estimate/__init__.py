"""Before a job is queued: the per-GPU memory estimate, the communication volume per step and the
planner that chooses a layout from them (torch-free, for ``--dry-run`` and ``--plan``)."""
