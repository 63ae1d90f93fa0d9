"""What runs inside each rank around the trainer: the task (a rank's entry point), its environment,
the run directory and its owner, stop signals, the smoke step and the hang watchdog. Imports
nothing here: a task installs its signal handler before torch is imported."""
