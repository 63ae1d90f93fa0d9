"""The local path: `submit.py CONFIG --local` runs every rank as a local gloo process, streams
rank 0, and a failing rank ends the whole job quickly (a hang is a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from nanotrain.launch.local import run_local

ROOT = Path(__file__).resolve().parents[1]


def read_smoke_reports(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "smoke").glob("rank-*.json"))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_local_run_8_processes(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "submit.py"),
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            "--local",
            "--set",
            f"logging.dir={tmp_path}",
            "--set",
            "logging.run_name=local8",
            "--set",
            "training.train_steps=3",
            "--set",
            "checkpoints.interval=0",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "smoke: ok: world=8 backend=gloo launcher=local" in proc.stdout  # rank 0 streamed
    reports = read_smoke_reports(tmp_path / "local8")
    assert [r["rank"] for r in reports] == sorted(range(8), key=str)
    for report in reports:
        assert report["ok"] and report["world_size"] == 8 and report["launcher"] == "local"
        for axis, result in report["sums"].items():
            assert result["got"] == result["expected"] == sum(result["ranks"]), (report["rank"], axis)
    assert (tmp_path / "local8" / "job" / "rank-7.log").is_file()
    assert "step 3/3 | loss" in proc.stdout  # the metrics rank (last stage) streams too


def test_failing_rank_ends_the_job(tmp_path):
    """Rank 2 fails at once while the others would sleep for 10 minutes: the job must end
    within seconds with rank 2's status, and no rank may survive."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '2':\n    sys.exit(3)\n"
        "print('pid', os.getpid(), flush=True)\ntime.sleep(600)\n"
    )
    start = time.monotonic()
    status = run_local([sys.executable, str(script)], 4, tmp_path / "job", quiet=True)
    assert status == 3
    assert time.monotonic() - start < 30
    for rank in (0, 1, 3):
        text = (tmp_path / "job" / f"rank-{rank}.log").read_text()
        pid = int(text.split()[1]) if text.startswith("pid") else None
        if pid is not None:
            assert not alive(pid), f"rank {rank} (pid {pid}) survived"


RANK_SCRIPT = """import os, signal, sys
rank = int(os.environ['RANK'])
print('rank', rank, 'argv', sys.argv[1:], 'world', os.environ['WORLD_SIZE'], 'main', __name__, flush=True)
print('stderr of', rank, file=sys.stderr, flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(10 + rank)
"""


def _launch(tmp_path, fork: str) -> tuple[list, list[str], dict]:
    from nanotrain.launch.ranks import RankProcesses

    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    log_dir = tmp_path / f"fork-{fork}"
    with RankProcesses(
        [sys.executable, str(script), "a b", "c"], 3, log_dir, env={"NANOTRAIN_FORK_SERVER": fork}
    ) as ranks:
        ranks.start()
        assert (ranks._server is not None) == (fork == "1")
        deadline = time.monotonic() + 60
        while not ranks.done():
            assert time.monotonic() < deadline, "the ranks did not exit"
            time.sleep(0.05)
        codes = ranks.codes()
    logs = [(log_dir / f"rank-{r}.log").read_text() for r in range(3)]
    return codes, logs, json.loads((log_dir / "ranks.json").read_text())


def test_fork_server_ranks_behave_as_their_own_interpreters(tmp_path):
    """The same script through the fork server and as separate interpreters: the same argv,
    environment, ``__main__``, both streams in the rank's log, exit codes (a signal as
    ``Popen`` reports it: -9), and ``ranks.json`` naming each rank's pid."""
    forked = _launch(tmp_path, "1")
    plain = _launch(tmp_path, "0")
    for codes, logs, pids in (forked, plain):
        assert codes == [10, -9, 12]
        for rank, text in enumerate(logs):
            assert f"rank {rank} argv ['a b', 'c'] world 3 main __main__" in text
            assert f"stderr of {rank}" in text
        assert sorted(pids["ranks"]) == ["0", "1", "2"]
    assert len(set(forked[2]["ranks"].values())) == 3


def test_a_preloaded_rank_module_runs_without_runpy_warnings(tmp_path):
    """The fork server imports the rank's module (PRELOAD) before forking; run as ``-m`` it must
    behave as a fresh ``python -m``: its own output only, no runpy "found in sys.modules" warning."""
    from nanotrain.launch.forkserver import PRELOAD
    from nanotrain.launch.ranks import RankProcesses

    module = "nanotrain.runtime.task"
    assert module in PRELOAD
    with RankProcesses([sys.executable, "-m", module], 2, tmp_path, env={"NANOTRAIN_FORK_SERVER": "1"}) as ranks:
        ranks.start()
        assert ranks._server is not None
        deadline = time.monotonic() + 60
        while not ranks.done():
            assert time.monotonic() < deadline, "the ranks did not exit"
            time.sleep(0.05)
        codes = ranks.codes()
    assert codes == [2, 2]
    for rank in (0, 1):
        log = (tmp_path / f"rank-{rank}.log").read_text()
        assert log == "usage: python -m nanotrain.runtime.task CONFIG.yaml\n", log
