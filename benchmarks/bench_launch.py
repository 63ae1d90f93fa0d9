"""Run a benchmark's worker function on N local ranks and get rank 0's result back.

The ranks are started by ``nanotrain.launch.ranks``, the launcher behind ``submit.py --local``
(the same env:// variables, sessions, fail-fast and deadline), not by ``torch.multiprocessing``:
one launcher for the product, the benchmarks and the tests. A benchmark script calls
``run_workers(__file__, world, payload, timeout_s)``; the ranks run ``SCRIPT --worker PAYLOAD
OUT``: the script ends with ``entry(main, worker)``, which runs ``worker`` on such a rank and
``main`` otherwise.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.launch.ranks import run_ranks  # noqa: E402


def run_workers(script: str, world: int, payload, timeout_s: float = 1800, log_dir: Path | None = None):
    """Rank 0's JSON result of ``script``'s worker given ``payload`` (JSON) on ``world`` ranks.

    Raises ``nanotrain.launch.ranks.RanksFailed`` (with the failing rank's log tail) if a rank
    fails or the launch runs past ``timeout_s``. The ranks' logs go to ``log_dir`` when given
    (kept), else to a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="nanotrain-bench-") as tmp:
        out = Path(tmp) / "result.json"
        run_ranks(
            [sys.executable, "-u", script, "--worker", json.dumps(payload), str(out)],
            world,
            Path(log_dir or Path(tmp) / "logs"),
            timeout_s,
        )
        return json.loads(out.read_text())


def worker_main(fn) -> None:
    """The ``--worker PAYLOAD OUT`` branch: ``fn(payload)`` on this rank; rank 0 writes the result."""
    import os

    payload, out = json.loads(sys.argv[2]), sys.argv[3]
    result = fn(payload)
    if os.environ["RANK"] == "0":
        Path(out).write_text(json.dumps(result))


def entry(main, worker) -> None:
    """A benchmark script's ``__main__``: ``worker`` on a rank (``--worker``), else ``main()``,
    whose return value (None or an int) is the exit status."""
    if sys.argv[1:2] == ["--worker"]:
        worker_main(worker)
    else:
        sys.exit(main())


def same_loss(value: float, reference: float, rtol: float = 1e-5) -> bool:
    """Two layouts of one model and data agree: the first loss within ``rtol`` of the reference."""
    return abs(value - reference) <= rtol * abs(reference)
