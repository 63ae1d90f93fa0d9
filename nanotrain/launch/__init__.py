"""Starting a job's processes: a SLURM job through submitit (``sbatch``, ``submission``) or local
ranks on this machine (``local``, ``ranks``, and the fork server that starts them quickly)."""
