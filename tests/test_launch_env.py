"""Environment -> torch env:// variables for each launcher. Real SLURM and local runs are covered
by test_slurm_submit.py / test_launch_local.py; here are the cases one machine cannot show
(4 real nodes with GPUs bound per node, torchrun inside srun), on submitit's own parser."""

from __future__ import annotations

import os
import random

import pytest

from nanotrain.runtime.env import detect_launcher, export_user_env, setup_distributed_env

SLURM_4_NODES = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "13",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "3",
    "SLURM_JOB_NODELIST": "gpu[001-003,007]",
    "SLURM_STEP_ID": "0",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    # inherited from the submitting shell by sbatch's --export=ALL: must not leak into the job
    "MASTER_ADDR": "login-node",
    "MASTER_PORT": "1234",
    "RANK": "0",
    "WORLD_SIZE": "1",
}
CLEAN = [
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "NANOTRAIN_LAUNCHER",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SUBMITIT_EXECUTOR",
    "NANOTRAIN_MASTER_PORT",
]


@pytest.fixture
def env(monkeypatch):
    for var in CLEAN:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_slurm_task_maps_to_torch_variables(env):
    for key, value in SLURM_4_NODES.items():
        env.setenv(key, value)
    dist_env = setup_distributed_env()
    assert dist_env.launcher == "slurm"
    assert (dist_env.rank, dist_env.world_size, dist_env.local_rank) == (13, 16, 1)
    assert (dist_env.node_rank, dist_env.num_nodes, dist_env.local_world_size) == (3, 4, 4)
    assert os.environ["MASTER_ADDR"] == "gpu001"  # first host of the allocation
    expected_port = random.Random("4242").randint(20000, 60000)  # derived from the job id
    assert int(os.environ["MASTER_PORT"]) == expected_port == dist_env.master_port
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("13", "16", "1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # GPUs bound per node stay visible


def test_slurm_port_override(env):
    for key, value in SLURM_4_NODES.items():
        env.setenv(key, value)
    env.setenv("NANOTRAIN_MASTER_PORT", "29999")
    assert setup_distributed_env().master_port == 29999


def test_torchrun_inside_srun_wins(env):
    for key, value in SLURM_4_NODES.items():
        env.setenv(key, value)
    env.setenv("TORCHELASTIC_RUN_ID", "abc")
    env.setenv("LOCAL_RANK", "0")
    env.setenv("LOCAL_WORLD_SIZE", "1")
    assert detect_launcher() == "torchrun"
    dist_env = setup_distributed_env()
    assert (dist_env.rank, dist_env.world_size, dist_env.master_addr) == (0, 1, "login-node")


def test_single_process_gets_a_free_port(env):
    dist_env = setup_distributed_env()
    assert dist_env.launcher == "single" and dist_env.world_size == 1
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0


def test_local_launcher_marker(env):
    env.setenv("NANOTRAIN_LAUNCHER", "local")
    for key, value in {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "23456",
    }.items():
        env.setenv(key, value)
    dist_env = setup_distributed_env()
    assert (dist_env.launcher, dist_env.rank, dist_env.world_size, dist_env.num_nodes) == ("local", 3, 8, 1)


def test_user_env_exported(env):
    env.delenv("NCCL_SOCKET_IFNAME", raising=False)
    export_user_env({"NCCL_SOCKET_IFNAME": "ib0"})
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


@pytest.mark.parametrize("launcher", ["slurm", "torchrun", "env://", "local", "single"])
def test_every_launcher_exports_local_world_size(env, launcher):
    """ParallelContext picks the GPU from LOCAL_RANK and LOCAL_WORLD_SIZE, so every launch path
    must leave both in the environment, agreeing with its DistEnv."""
    given = {
        "slurm": SLURM_4_NODES,
        "torchrun": {
            "TORCHELASTIC_RUN_ID": "abc",
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "29500",
        },
        "env://": {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        "local": {
            "NANOTRAIN_LAUNCHER": "local",
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "3",
            "LOCAL_WORLD_SIZE": "8",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "23456",
        },
        "single": {},
    }[launcher]
    for key, value in given.items():
        env.setenv(key, value)
    dist_env = setup_distributed_env()
    assert os.environ["LOCAL_WORLD_SIZE"] == str(dist_env.local_world_size)
    assert os.environ["LOCAL_RANK"] == str(dist_env.local_rank)


def test_free_port_is_below_the_ephemeral_range():
    """A port the kernel hands to no other socket between the launcher's check and rank 0's bind
    (ephemeral ports are: another job's gloo connections took one now and then: EADDRINUSE)."""
    from nanotrain.runtime.env import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (low, ports)
    assert len(ports) > 1  # drawn at random, not the same first free port for every launcher
    assert _ephemeral_low("/nonexistent") == 32768
