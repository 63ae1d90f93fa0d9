"""Node health and exclusion, without SLURM (issue 31, items 1 and 4; the real cluster's test is
tests/test_slurm_health.py): the start-up check's verdict (lower median, one value per node for
the all-reduces, a node named across nodes only when every pair of it is slow), the check itself
on 4 gloo ranks "on two nodes" with the fault hook slowing one, the exclusion record and its
requeue (requeuehold, update ExcNodeList, release; each refusal), `--exclude` on a resume, the
straggler watch, the hang culprit's node and its exclusion, `--status`'s lines, and the
flight-recorder settings and dump."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanotrain.config import load_config
from nanotrain.config.validate_slurm import health_enabled, max_excluded_nodes
from nanotrain.logging.stragglers import StragglerWatch
from nanotrain.runtime import exclusions, preemption, slurm_commands
from nanotrain.runtime.health import judge, ring_rounds, slow_factor

from helpers.dist import run_distributed
from helpers.runs import TINY

LIMITS = dict(matmul_slowdown=1.5, allreduce_slowdown=2.0)


def _results(nodes, matmul, in_node=None, across=None):
    out = []
    for rank, node in enumerate(nodes):
        out.append(
            {
                "rank": rank,
                "node": node,
                "matmul": matmul[rank],
                "all-reduce in node": None if in_node is None else in_node[rank],
                "all-reduce across nodes": None if across is None else across[rank],
            }
        )
    return out


# ----------------------------------------------------------------------------- the verdict
def test_one_slow_node_of_two_is_measured_against_the_healthy_one():
    nodes = ["n1", "n1", "n2", "n2"]
    verdict = judge(
        _results(nodes, [1.0, 1.1, 10.0, 10.2], in_node=[1.0, 1.0, 9.0, 9.0], across=[2.0, None, 20.0, None]),
        **LIMITS,
    )
    # the lower median of two nodes is the healthy one: 9x, not 9 / 5 = 1.8x
    assert verdict["slow_nodes"] == ["n2"]
    checks = {(s["check"], s["node"]) for s in verdict["slow"]}
    assert checks == {("matmul", "n2"), ("all-reduce in node", "n2"), ("all-reduce across nodes", "n2")}
    node_check = next(s for s in verdict["slow"] if s["check"] == "all-reduce in node")
    assert node_check["ranks"] == [2, 3] and node_check["ratio"] == 9.0


def test_a_healthy_job_and_noise_below_the_limits_name_nothing():
    nodes = ["a"] * 4 + ["b"] * 4
    verdict = judge(_results(nodes, [1.0, 1.2, 1.1, 1.3, 1.0, 1.4, 1.1, 1.2], in_node=[1.0] * 4 + [1.9] * 4), **LIMITS)
    assert verdict["slow"] == [] and verdict["slow_nodes"] == []
    assert verdict["checks"]["matmul"]["max_ratio"] == pytest.approx(1.4 / 1.1)  # the lower median: 1.1
    one_task = judge(_results(["a"], [5.0]), **LIMITS)
    assert one_task["checks"] == {} and one_task["slow_nodes"] == []


def test_slow_nodes_are_ordered_worst_first():
    nodes = ["a", "b", "c", "d", "e"]
    verdict = judge(_results(nodes, [1.0, 3.0, 1.0, 2.0, 1.0]), **LIMITS)
    assert verdict["slow_nodes"] == ["b", "d"]


def test_the_ring_rounds_pair_every_neighbour_once_and_no_node_twice_a_round():
    assert ring_rounds(1) == [] and ring_rounds(2) == [[(0, 1)]]
    for count in range(3, 12):
        rounds = ring_rounds(count)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == sorted((i, (i + 1) % count) for i in range(count))
        assert len(rounds) <= 3
        for members in rounds:
            used = [n for p in members for n in p]
            assert len(used) == len(set(used)), (count, rounds)


def test_the_fault_hook_names_a_node_and_a_factor():
    env = {"NANOTRAIN_TEST_SLOW_NODE": "n2"}
    assert slow_factor("n2", env) == 10.0 and slow_factor("n1", env) == 1.0 and slow_factor("n2", {}) == 1.0
    assert slow_factor("n2", {"NANOTRAIN_TEST_SLOW_NODE": "n2:3"}) == 3.0


def test_defaults_follow_the_nodes():
    cpu = load_config(str(TINY))
    assert not health_enabled(cpu) and max_excluded_nodes(cpu) == 0
    gpu = load_config(str(TINY), ["slurm.gpus_per_node=8"])
    assert health_enabled(gpu) and max_excluded_nodes(gpu) == 4
    chosen = load_config(str(TINY), ["slurm.health.enabled=true", "slurm.max_excluded_nodes=1"])
    assert health_enabled(chosen) and max_excluded_nodes(chosen) == 1


# --------------------------------------------------------- the check on 4 gloo ranks, 2 "nodes"
def check_on_two_nodes(run_dir: str) -> dict:
    """Rank side: ranks 0, 1 on node a, 2, 3 on node b (SLURMD_NODENAME), the check as a job runs
    it; then a collective through nanotrain's wrappers and the hang watchdog's report of it."""
    os.environ["SLURMD_NODENAME"] = "a" if int(os.environ["RANK"]) < 2 else "b"
    from nanotrain.runtime.hang import nccl_debug_env

    nccl_debug_env(Path(run_dir))  # as a rank sets it, before its process groups exist
    import torch
    import torch.distributed as dist

    from nanotrain.parallel import collectives
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.runtime.env import setup_distributed_env
    from nanotrain.runtime.hang import HangWatchdog
    from nanotrain.runtime.health import health_check

    env = setup_distributed_env()
    pc = ParallelContext(data_parallel_size=4, timeout_s=60)
    try:
        groups = len(dist.distributed_c10d._world.pg_map)
        config = load_config(str(TINY), ["slurm.health.enabled=true"])
        verdict = health_check(pc, config, env, Path(run_dir))
        groups_after = len(dist.distributed_c10d._world.pg_map)
        collectives.all_reduce(torch.ones(4), group=pc.get_group("dp"), what="all_reduce the test's tensor")
        path = HangWatchdog(Path(run_dir), env.rank, env.world_size, 60).report("exercise")
    finally:
        pc.destroy()
    return {
        **{k: verdict[k] for k in ("slow_nodes", "seconds", "nodes", "checks")},
        "groups_added": groups_after - groups,
        "hang_report": json.loads(Path(path).read_text()),
    }


@pytest.mark.timeout(150)
def test_the_check_names_the_slowed_node_and_a_hang_report_carries_the_flight_recorder(tmp_path):
    """One 4-rank gloo job for both (a job's start-up is most of the time): the check with node b
    slowed 20x, then a hang report, whose flight-recorder dump gloo fills with torch 2.13."""
    results = run_distributed(
        check_on_two_nodes, 4, str(tmp_path), timeout=130, env={"NANOTRAIN_TEST_SLOW_NODE": "b:20"}
    )
    for r in results:  # every rank reaches the same verdict
        assert r["slow_nodes"] == ["b"] and r["nodes"] == ["a", "a", "b", "b"], r
        assert set(r["checks"]) == {"matmul", "all-reduce in node", "all-reduce across nodes"}
        assert r["seconds"] < 10 and r["groups_added"] == 0  # its groups are destroyed again
    record = [json.loads(line) for line in (tmp_path / "health" / "startup.jsonl").read_text().splitlines()]
    assert len(record) == 1 and record[0]["slow_nodes"] == ["b"] and len(record[0]["results"]) == 4
    assert {s["node"] for s in record[0]["slow"]} == {"b"}
    line = exclusions.startup_line(record[0])
    assert "slow: b matmul" in line and "all-reduce in node" in line
    # item 4: the hang report names node, host, rank, group and the last collective, and holds
    # torch's flight recorder, also as torch's own dump file in the run's hang directory
    for rank, r in enumerate(results):
        report = r["hang_report"]
        assert report["node"] == ("a" if rank < 2 else "b") and report["host"] and report["rank"] == rank
        coll = report["collective"]  # dp is the world here: the group carries every name it has
        assert coll["name"] == "all_reduce the test's tensor" and coll["group"]["ranks"] == [0, 1, 2, 3]
        assert "dp" in coll["group"]["name"].split("/")
        entries = report["flight_recorder"]["entries"]
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in entries), entries
        dump = Path(report["flight_recorder_file"])
        assert dump == tmp_path / "hang" / f"nccl_trace_rank_{rank}"
        data = pickle.loads(dump.read_bytes())  # torch's own format: torchfrtrace reads it
        assert {"entries", "pg_config", "version"} <= set(data)


# ------------------------------------------------------------------ the record and the requeue
class FakeScontrol:
    """slurm_commands.run for scontrol/sinfo: records every call; ``refuse``: verbs that fail."""

    def __init__(self, excluded: str = "(null)", refuse=(), restarts: int = 0):
        self.calls, self.excluded, self.refuse, self.restarts = [], excluded, set(refuse), restarts

    def __call__(self, argv, limit_s=None, survive_term=False):
        self.calls.append(argv)
        if argv[0] == "scontrol" and argv[1] in ("hold", "requeuehold", "update", "release"):
            assert survive_term, argv  # the requeue's SIGTERM reaches the commands after it too
        verb = argv[1] if argv[0] == "scontrol" else argv[0]
        out = ""
        if argv[:3] == ["scontrol", "show", "job"]:
            out = f"JobId=7 JobState=RUNNING Restarts={self.restarts}\n   ExcNodeList={self.excluded}\n"
        elif argv[:3] == ["scontrol", "show", "hostnames"]:
            out = "\n".join(argv[3].replace("n[1-2]", "n1,n2").split(",")) + "\n"
        elif argv[0] == "sinfo":
            out = "n1 idle\nn2 idle\n"
        elif verb == "update" and verb not in self.refuse:
            self.excluded = argv[3].split("=", 1)[1]
        rc = 1 if verb in self.refuse else 0
        return subprocess.CompletedProcess(argv, rc, out, f"scontrol: error: {verb} refused" if rc else "")

    def actions(self):
        return [c[1:] for c in self.calls if c[0] == "scontrol" and c[1] != "show"]


def test_the_record_keeps_nodes_up_to_the_limit(tmp_path):
    assert exclusions.add(tmp_path, "n2", "health", "slow", 1, "7", 0) == (True, "excluded")
    assert exclusions.add(tmp_path, "n2", "hang", "again", 1) == (False, "already excluded")
    added, note = exclusions.add(tmp_path, "n3", "hang", "hung", 1)
    assert not added and "slurm.max_excluded_nodes is 1" in note and "n2" in note
    assert exclusions.add(tmp_path, "n1; rm -rf", "hang", "x", 5)[0] is False  # not a node name
    assert exclusions.excluded(tmp_path, 4) == ["n2"] and exclusions.excluded(tmp_path, 0) == []
    (tmp_path / exclusions.EXCLUDED_FILE).write_text("{not json")
    assert exclusions.read_record(tmp_path) == {"nodes": [], "applied": []}


def test_requeue_holds_updates_and_releases(monkeypatch):
    fake = FakeScontrol(excluded="n[1-2]")  # the user's own sbatch --exclude stays
    monkeypatch.setattr(slurm_commands, "run", fake)
    requeued, note = exclusions.requeue_excluding("7", ["n3"])
    assert requeued and note == "ExcNodeList=n1,n2,n3"
    assert fake.actions() == [["requeuehold", "7"], ["update", "JobId=7", "ExcNodeList=n1,n2,n3"], ["release", "7"]]


def test_requeue_when_scontrol_refuses(monkeypatch):
    fake = FakeScontrol(refuse={"requeuehold"})  # a cluster without requeuehold: a plain requeue
    monkeypatch.setattr(slurm_commands, "run", fake)
    requeued, note = exclusions.requeue_excluding("7", ["n2"])
    assert requeued and "requeued without the exclusion" in note
    assert fake.actions() == [["requeuehold", "7"], ["requeue", "7"]]
    fake = FakeScontrol(refuse={"update"})  # the update refused: released anyway, never left held
    monkeypatch.setattr(slurm_commands, "run", fake)
    requeued, note = exclusions.requeue_excluding("7", ["n2"])
    assert requeued and "exclusion refused by scontrol update" in note and fake.actions()[-1] == ["release", "7"]
    fake = FakeScontrol(refuse={"release"})  # twice refused: the log says how to release it
    monkeypatch.setattr(slurm_commands, "run", fake)
    requeued, note = exclusions.requeue_excluding("7", ["n2"])
    assert "scontrol release 7" in note and fake.actions()[-2:] == [["release", "7"], ["release", "7"]]
    fake = FakeScontrol()  # requeued by SLURM itself (pending): held, updated, released
    monkeypatch.setattr(slurm_commands, "run", fake)
    exclusions.requeue_excluding("7", ["n2"], already_requeued=True)
    assert fake.actions() == [["hold", "7"], ["update", "JobId=7", "ExcNodeList=n2"], ["release", "7"]]


def test_request_requeue_applies_the_runs_exclusions_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    exclusions.add(tmp_path, "n2", "health", "slow", 4, "7", 0)
    fake = FakeScontrol()
    monkeypatch.setattr(slurm_commands, "run", fake)
    assert preemption.request_requeue(3, tmp_path, 4)
    assert ["requeuehold", "7"] in fake.actions() and ["update", "JobId=7", "ExcNodeList=n2"] in fake.actions()
    applied = exclusions.read_record(tmp_path)["applied"]
    assert applied[-1]["nodes"] == ["n2"] and applied[-1]["job_id"] == "7"
    fake.calls.clear()  # the job avoids n2 now: the next requeue is a plain one
    assert preemption.request_requeue(3, tmp_path, 4)
    assert fake.actions() == [["requeue", "7"]]
    fake = FakeScontrol()  # slurm.max_excluded_nodes 0: the record is kept, never applied
    monkeypatch.setattr(slurm_commands, "run", fake)
    assert preemption.request_requeue(3, tmp_path, 0) and fake.actions() == [["requeue", "7"]]


def test_a_requeue_that_leaves_too_few_nodes_is_said(monkeypatch, tmp_path):
    monkeypatch.setattr(slurm_commands, "run", FakeScontrol())
    exclusions.add(tmp_path, "n2", "health", "slow", 4)
    env = {"SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "7"}
    warning = exclusions.fit_warning(tmp_path, 4, env)
    assert "needs 2 node(s) and partition debug has 1 usable outside the excluded n2" in warning
    assert "scancel 7" in warning and "--resume" in warning
    assert exclusions.fit_warning(tmp_path, 4, {**env, "SLURM_JOB_NUM_NODES": "1"}) is None
    # slurm.nodes '1-2': the requeue gets its range back and may land on the one node left
    assert exclusions.fit_warning(tmp_path, 4, env, min_nodes=1) is None
    assert "needs 2 node(s)" in exclusions.fit_warning(tmp_path, 4, {**env, "SLURM_JOB_NUM_NODES": "1"}, min_nodes=2)


def test_a_resume_submits_with_the_runs_exclusions(tmp_path):
    from nanotrain.config import slurm_layout
    from nanotrain.launch.sbatch import executor_parameters, render_sbatch, submitit_command

    config = load_config(str(TINY), ["slurm.max_excluded_nodes=2", "slurm.sbatch_extra.exclude=n9"])
    layout = slurm_layout(config)
    assert executor_parameters(config, layout, tmp_path)["additional_parameters"]["exclude"] == "n9"
    exclusions.add(tmp_path, "n2", "health", "slow", 2)
    params = executor_parameters(config, layout, tmp_path)
    assert params["additional_parameters"]["exclude"] == "n9,n2"
    assert "#SBATCH --exclude=n9,n2" in render_sbatch(config, layout, tmp_path, submitit_command(tmp_path))
    off = load_config(str(TINY), ["slurm.max_excluded_nodes=0"])
    assert "exclude" not in executor_parameters(off, layout, tmp_path).get("additional_parameters", {})


# -------------------------------------------------------------------------- the straggler watch
def test_a_rank_straggling_in_a_row_names_its_node_once(tmp_path):
    stages = [0, 0, 1, 1]  # pp2 x dp2: ranks 0, 1 one stage, 2, 3 the other (it computes the loss)
    nodes = ["n1", "n1", "n2", "n2"]
    watch = StragglerWatch(stages, lambda r: nodes[r], 1.5, 3, tmp_path, writer=True)
    balanced_but_stages_differ = [1.0, 1.0, 3.0, 3.1]  # stage 1 is slower by design: nobody straggles
    slow3 = [1.0, 1.0, 3.0, 6.0]
    assert watch.observe(balanced_but_stages_differ) == []
    assert watch.observe(slow3) == [] and watch.observe(slow3) == []
    assert watch.observe(balanced_but_stages_differ) == []  # the streak is broken
    found = [watch.observe(slow3) for _ in range(3)]
    assert found[:2] == [[], []] and [e["node"] for e in found[2]] == ["n2"] and found[2][0]["rank"] == 3
    assert all(watch.observe(slow3) == [] for _ in range(4))  # named once
    named = exclusions.straggler_nodes(tmp_path)
    assert [e["node"] for e in named] == ["n2"] and "busy 2.00x its pipeline stage's median" in named[0]["why"]
    # the next requeue merges it into the excluded nodes; --status lists it until then
    assert any("stragglers: n2" in line for line in exclusions.status_lines(tmp_path))
    exclusions.merge_stragglers(tmp_path, 4)
    assert exclusions.excluded(tmp_path, 4) == ["n2"]
    assert exclusions.read_record(tmp_path)["nodes"][0]["source"] == "stragglers"


# ------------------------------------------------------------------------------ hangs (item 4)
def _hang_report(rank, world, node, coll_ranks=None, time_=None):
    return {
        "rank": rank,
        "world_size": world,
        "host": "vm",
        "node": node,
        "time": time_ or time.time(),
        "job_id": "7",
        "restart": 0,
        "step": 7,
        "phase": "backward",
        "waiting_in_communication": True,
        "collective": {"name": "tp all_reduce", "group": {"name": "tp", "ranks": coll_ranks or [2, 3]}},
    }


def _write_hang(run_dir: Path, reports: list[dict], smoke: dict[int, dict]):
    (run_dir / "hang").mkdir(parents=True, exist_ok=True)
    (run_dir / "smoke").mkdir(parents=True, exist_ok=True)
    for r in reports:
        (run_dir / "hang" / f"rank-{r['rank']}.json").write_text(json.dumps(r))
    for rank, data in smoke.items():
        (run_dir / "smoke" / f"rank-{rank}.json").write_text(json.dumps(data))


def test_the_hang_culprit_is_named_with_its_node_and_excluded(monkeypatch, tmp_path):
    from nanotrain.runtime.ending import exclude_culprit_node
    from nanotrain.runtime.hang_status import hang_lines

    reports = [_hang_report(r, 4, "n1" if r < 2 else "n2") for r in (0, 1, 3)]  # rank 2 is silent
    smoke = {2: {"rank": 2, "job_id": "7", "restart": 0, "host": "vm", "node": "n2"}}
    _write_hang(tmp_path, reports, smoke)
    lines = hang_lines(tmp_path)
    assert "rank 2 (node n2, host vm) did not reach tp all_reduce on tp (ranks 2, 3)" in lines[0], lines
    monkeypatch.setattr(slurm_commands, "run", FakeScontrol())
    env = SimpleNamespace(world_size=4, job_id="7", restart_count=0)
    exclude_culprit_node(tmp_path, env, 4, settle_s=1.0)
    record = exclusions.read_record(tmp_path)["nodes"]
    assert [(e["node"], e["source"]) for e in record] == [("n2", "hang")] and "rank 2" in record[0]["why"]
    # a smoke report of another incarnation does not say where the rank runs now
    other = tmp_path / "other"
    _write_hang(other, reports, {2: {**smoke[2], "restart": 1}})
    assert "rank 2 did not reach" in hang_lines(other)[0]


def test_a_hang_with_too_few_reports_excludes_nothing(tmp_path, capsys):
    from nanotrain.runtime.ending import exclude_culprit_node

    _write_hang(tmp_path, [_hang_report(0, 4, "n1")], {})
    t0 = time.monotonic()
    exclude_culprit_node(tmp_path, SimpleNamespace(world_size=4, job_id="7", restart_count=0), 4, settle_s=0.5)
    assert time.monotonic() - t0 < 3
    assert exclusions.read_record(tmp_path)["nodes"] == [] and "culprit unclear (1 of 4" in capsys.readouterr().out


def test_the_flight_recorders_buffer_variable_is_the_installed_torchs():
    from nanotrain.runtime.hang import fr_buffer_var

    assert fr_buffer_var("2.13.0+cpu") == "TORCH_FR_BUFFER_SIZE" and fr_buffer_var("2.7.1") == "TORCH_FR_BUFFER_SIZE"
    assert fr_buffer_var("2.5.1+cu124") == "TORCH_NCCL_TRACE_BUFFER_SIZE"  # what 2.5 and 2.6 read


# ------------------------------------------------------------------------------------ --status
def test_status_shows_health_exclusions_and_the_wait(monkeypatch, tmp_path, capsys):
    from nanotrain.commands import status

    run = tmp_path / "run"
    (run / "health").mkdir(parents=True)
    (run / "launch.json").write_text(json.dumps({"mode": "slurm", "job_id": "7"}))
    entry = {
        "job_id": "7",
        "restart": 0,
        "seconds": 1.2,
        "node_count": 2,
        "tasks": 4,
        "checks": {"matmul": {"median_s": 0.001, "max_ratio": 10.0}},
        "slow": [{"node": "n2", "check": "matmul", "ratio": 10.0, "limit": 1.5, "ranks": [2]}],
        "slow_nodes": ["n2"],
    }
    (run / "health" / "startup.jsonl").write_text(json.dumps(entry) + "\n")
    exclusions.add(run, "n2", "health", "rank 2 matmul 10.0x the median", 4, "7", 0)
    exclusions.note_applied(run, "7", 1, ["n2"], "ExcNodeList=n2")
    answers = {
        "squeue": {"state": "PENDING", "nodes": None, "reason": "BadConstraints"},
        "sacct": None,
        "scontrol": {"state": "PENDING", "nodes": None, "restarts": 1, "reason": "BadConstraints", "exit_code": 0},
    }
    monkeypatch.setattr(status, "query_squeue", lambda j: answers["squeue"])
    monkeypatch.setattr(status, "query_sacct", lambda j: answers["sacct"])
    monkeypatch.setattr(status, "query_scontrol", lambda j: answers["scontrol"])
    status.show_status(run)
    out = capsys.readouterr().out
    assert "health (job 7 restart 0, 1.2 s, 2 node(s), 4 tasks): slow: n2 matmul 10.0x the median" in out, out
    assert "excluded nodes: n2 (health, job 7 restart 0: rank 2 matmul 10.0x the median)" in out, out
    assert "exclusion applied: job 7 ExcNodeList n2" in out
    assert "note: the job waits for nodes outside the excluded n2" in out and "scancel 7" in out
