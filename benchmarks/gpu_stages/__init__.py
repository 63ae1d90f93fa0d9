"""The stages of ``benchmarks/gpu_check.sh``, split by purpose; ``benchmarks/gpu_trainer_check.py``
is their entry point (arguments, the stage list, the summary), so its CLI and outputs stay one.

    limits.py           the budget, the caps, the models and package lists every stage shares
    check.py            ``Check``: the budget's deadlines, ``check.run`` (subprocess + log + kill), the summary
    workspace.py        the temporary folder: configs, environments, the fork server, the token cache
    runs.py             reading a trainer run back: losses, resume verdicts, memory
    trainer.py          stage 3, the single-rank trainer runs
    environment.py      stages 1-2: versions and ``pytest -m gpu``
    multi_gpu.py        stage 4, tp x pp through ``submit.py --local``
    flight_recorder.py  stage 5, the hang report's flight recorder
    measurements.py     stages 6-8: rehearsal, masked attention, the benchmark
"""
