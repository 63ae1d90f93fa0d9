"""The user's commands: ``submit.py`` (and the ``nanotrain`` console script) — parse, check, plan,
report a run's status, prepare data, then hand a job to ``launch``. Imports nothing here, so that
``submit.py --dry-run`` stays torch-free."""
