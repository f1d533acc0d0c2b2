import re

import pytest
import torch

from distzo import ZOConfig
from distzo.dist import LaunchEnv, ParallelContext, ParallelDims
from distzo.dist import process_group as pg
from distzo.runtime.option_names import named_as_flags
from tests.helpers.launch import main_in_process


@pytest.mark.parametrize(
    "world, dp, pert, expected",
    [
        (1, None, None, (1, 1)),
        (2, None, None, (1, 2)),
        (3, None, None, (3, 1)),
        (4, None, None, (2, 2)),
        (4, None, 1, (4, 1)),
        (4, 4, None, (4, 1)),
        (4, 2, None, (2, 2)),
        (2, 1, 2, (1, 2)),
        (8, 2, None, (2, 4)),  # a pert group of 4: FZOO's or n-SPSA's passes over 4 ranks
        (9, None, 9, (1, 9)),
        (6, 2, 3, (2, 3)),
    ],
)
def test_auto_and_explicit_layouts(world, dp, pert, expected):
    dims = ParallelDims.resolve(world, dp, pert)
    assert (dims.dp, dims.pert) == expected
    assert dims.world_size == world


@pytest.mark.parametrize(
    "world, dp, pert, message",
    [
        (4, 3, 2, "does not match the 4 launched ranks"),
        (4, None, 3, "--pert 3 does not divide the 4 launched ranks; use --pert 1, --pert 2 or "),
        (3, None, 2, "does not divide"),
        (8, 3, None, "--dp 3 does not divide .*; use --dp 1, --dp 2, --dp 4 or --dp 8$"),
        (4, None, 0, "--pert must be >= 1"),
        (2, 0, None, "--dp must be >= 1"),
    ],
)
def test_invalid_layouts_are_one_line_errors(world, dp, pert, message):
    with named_as_flags(), pytest.raises(ValueError, match=message) as info:
        ParallelDims.resolve(world, dp, pert)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "world, dp, pert, message",
    [
        (
            8,
            3,
            None,
            "^dp 3 does not divide .*, so no pert fills .*; use dp 1, dp 2, dp 4 or dp 8$",
        ),
        (4, None, 3, r"^pert 3 does not divide the 4 launched ranks; .* \(pert 1: every rank"),
        (4, 3, 2, "^dp 3 x pert 2 = 6 does not match the 4 launched ranks"),
        (2, 0, None, "^dp must be >= 1"),
    ],
)
def test_a_layout_resolved_from_python_names_its_arguments(world, dp, pert, message):
    """The docs' torchrun script calls ``ParallelDims.resolve(world, dp, pert)``, which has no
    --dp flag: its errors name the arguments."""
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(world, dp, pert)


def test_a_pert_group_needs_a_pass_for_every_rank():
    ParallelDims(1, 9).check_passes("fzoo", 8)  # N + 1 passes
    ParallelDims(1, 6).check_passes("spsa", 3)  # 2q passes
    with named_as_flags():
        with pytest.raises(ValueError, match="--pert 3 is more ranks than the 2 forward passes"):
            ParallelDims(1, 3).check_passes("spsa", 1)
        with pytest.raises(ValueError, match=r"forward passes of a step \(--estimator fzoo, "):
            ParallelDims(1, 10).check_passes("fzoo", 8)
    # a ZOEngine given that layout from Python: its config's fields, not flags
    with pytest.raises(
        ValueError,
        match=r"^pert 3 is .* \(estimator spsa, num_queries 1\); use pert 2 or fewer, or more "
        "num_queries$",
    ):
        ParallelDims(1, 3).check_passes("spsa", 1)


def test_batch_must_split_over_dp():
    ParallelDims(2, 2).check_batch(8)
    ParallelDims(2, 2).check_batch(6)  # 3 rows per dp group: a pert pair shares its rows
    ParallelDims(1, 4).check_batch(3)
    with pytest.raises(ValueError, match="--batch-size 7 is not divisible by --dp 2"):
        ParallelDims(2, 2).check_batch(7)


def test_a_batch_that_does_not_split_over_dp_is_refused_not_cut():
    """``shard_batch`` is the Python API's split: 7 rows over dp 2 gave 3 + 3, the last row
    dropped while the global batch's num_items still counted it. Its caller passed rows,
    not a --batch-size."""
    ctx = ParallelContext(LaunchEnv(rank=2, world_size=4, launched=True), ParallelDims(2, 2))
    with pytest.raises(
        ValueError,
        match="^shard_batch: the batch's 7 rows do not split over dp 2; pass a multiple of 2 rows$",
    ):
        ctx.shard_batch({"input_ids": torch.arange(7).view(7, 1)})


def test_row_major_mesh_coordinates_pair_neighbours():
    dims = ParallelDims(2, 2)
    assert [dims.coordinates(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("dp, pert", [(4, 2), (2, 3), (1, 3), (3, 1)])
def test_coordinates_of_a_non_square_mesh_are_the_row_major_meshs(dp, pert):
    """The mesh-less coordinates (a context without a DeviceMesh, the rank summary's
    formula) are where each rank sits in ``init_device_mesh``'s row-major (dp, pert) grid."""
    grid = torch.arange(dp * pert).view(dp, pert)
    expected = [tuple(int(i) for i in (grid == r).nonzero()[0]) for r in range(dp * pert)]
    assert [ParallelDims(dp, pert).coordinates(r) for r in range(dp * pert)] == expected


def test_pass_and_batch_shares_per_rank():
    batch = {"input_ids": torch.arange(8).view(8, 1)}
    spsa = ZOConfig(device="cpu", num_queries=2).step_passes()
    fzoo = ZOConfig(device="cpu", estimator="fzoo", num_queries=8, noise="rademacher")
    seen, fzoo_shares = {}, {}
    for rank in range(4):
        ctx = ParallelContext(LaunchEnv(rank=rank, world_size=4, launched=True), ParallelDims(2, 2))
        seen[rank] = (ctx.own_passes(spsa), ctx.shard_batch(batch)["input_ids"].view(-1).tolist())
        fzoo_shares[rank] = ctx.own_passes(fzoo.step_passes())
    # a pert pair: same rows; SPSA's +eps passes on one rank, its -eps passes on the other
    plus, minus = ((0, 1), (1, 1)), ((0, -1), (1, -1))
    assert seen[0] == (plus, [0, 1, 2, 3]) and seen[1] == (minus, [0, 1, 2, 3])
    assert seen[2] == (plus, [4, 5, 6, 7]) and seen[3] == (minus, [4, 5, 6, 7])
    assert ParallelContext.single().own_passes(spsa) == ((0, 1), (0, -1), (1, 1), (1, -1))
    # FZOO's 8 one-sided passes and the unperturbed one: 5 and 4, each pass on one rank
    assert fzoo_shares[0] == ((0, 1), (2, 1), (4, 1), (6, 1), (0, 0))
    assert fzoo_shares[1] == ((1, 1), (3, 1), (5, 1), (7, 1))
    assert fzoo_shares[2] == fzoo_shares[0] and fzoo_shares[3] == fzoo_shares[1]


def test_launch_env_reads_torchrun_variables():
    env = LaunchEnv.from_environ(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
        }
    )
    assert env == LaunchEnv(
        rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, launched=True
    )
    assert LaunchEnv.from_environ({}) == LaunchEnv()
    assert not LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}).launched
    one = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}  # torchrun's world of one
    assert LaunchEnv.from_environ(one).launched


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "the launcher's RANK='x' is not a whole number"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 and LOCAL_WORLD_SIZE=0 make no job"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not below WORLD_SIZE=2"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "make no job"),
    ],
)
def test_launcher_variables_no_launcher_writes_are_one_line_at_once(environ, message):
    """Once a traceback, or a rank past the world waiting out --dist-timeout for peers
    that never come and then blaming them."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LaunchEnv.from_environ(environ)
    proc = main_in_process("distzo.train", ["--max-steps", "1"], env=environ)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-1000:]
    assert lines[0].startswith("error: ") and message in lines[0]


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, "srun started 2 tasks"),
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}, "mpirun started 4 tasks"),
        ({"PMI_SIZE": "8", "PMI_RANK": "3"}, "mpirun started 8 tasks"),
    ],
)
def test_tasks_started_without_torchrun_are_refused(environ, message):
    """Once each task of ``srun -n 2 python -m distzo.train`` trained alone, all writing
    the same run directory."""
    with pytest.raises(ValueError, match=message + ".*without torchrun"):
        LaunchEnv.from_environ(environ)
    proc = main_in_process("distzo.train", ["--max-steps", "1"], env=environ)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-1000:]
    assert "torchrun --nproc_per_node" in lines[0]


def test_one_task_or_torchrun_under_a_task_launcher_is_a_job():
    # srun -n 1, or a batch script's own step: one task
    assert LaunchEnv.from_environ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}) == LaunchEnv()
    # torchrun started by srun (one agent per node) sets RANK: its ranks are the job's
    torchrun = {"SLURM_STEP_NUM_TASKS": "2", "RANK": "5", "WORLD_SIZE": "8"}
    assert LaunchEnv.from_environ(torchrun).rank == 5


def test_a_world_of_no_ranks_is_refused():
    with pytest.raises(ValueError, match="a job needs at least one rank, got 0"):
        ParallelDims.resolve(0)


@pytest.mark.parametrize(
    "threads, environ, local_ranks, expected",
    [
        (None, {}, 1, (1, "the default; --threads N or OMP_NUM_THREADS sets it")),
        (
            None,
            {"OMP_NUM_THREADS": ""},
            4,
            (1, "the default; --threads N or OMP_NUM_THREADS sets it"),
        ),
        (None, {"OMP_NUM_THREADS": "3"}, 1, (3, "OMP_NUM_THREADS")),
        (None, {"OMP_NUM_THREADS": " 4,2 "}, 1, (4, "OMP_NUM_THREADS")),  # OpenMP's nested form
        (3, {"OMP_NUM_THREADS": "1"}, 2, (3, "--threads")),  # the flag beats the environment
        (0, {"OMP_NUM_THREADS": "1"}, 1, (16, "--threads 0: 16 cores / 1 local ranks")),
        (0, {}, 3, (5, "--threads 0: 16 cores / 3 local ranks")),
        (0, {}, 32, (1, "--threads 0: 16 cores / 32 local ranks")),  # at least one
    ],
)
def test_cpu_threads_default_to_one_per_rank(threads, environ, local_ranks, expected):
    env = LaunchEnv(world_size=local_ranks, local_world_size=local_ranks, launched=True)
    assert pg.cpu_threads(threads, env, environ, cores=16) == expected


@pytest.mark.parametrize("value", ["0", "-2", "four", "2.5"])
def test_a_bad_omp_num_threads_is_one_line_naming_the_fix(value):
    with pytest.raises(ValueError, match="OMP_NUM_THREADS=.* is not a thread count; .*--threads N"):
        pg.cpu_threads(None, LaunchEnv(), {"OMP_NUM_THREADS": value})
