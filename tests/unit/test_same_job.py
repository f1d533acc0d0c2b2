"""Every rank of a launch runs one job in one run directory: the nodes' own command lines
may differ, and their disks (the integration test: tests/integration/test_dist_launch.py,
two torchrun agents)."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest

from distzo.config.job import resolve
from distzo.data.task_data import LoadedRows, rows_digest
from distzo.data.templates import Example
from distzo.dist import LaunchEnv
from distzo.job import same_job
from distzo.job.run_claim import RunClaim
from distzo.job.run_model import run_model
from distzo.job.same_job import _values, check_same_options, check_shared_run_dir


class Ranks:
    """A host group of two ranks seen from ``rank``: the other's gathered value is given,
    and a broadcast hands every rank rank 0's value (``sent`` stands in for it on rank 1)."""

    distributed = True

    def __init__(self, rank: int, other=None, sent=None) -> None:
        self.rank, self.other, self.sent = rank, other, sent

    def all_gather_object(self, mine):
        return [mine, self.other] if self.rank == 0 else [self.other, mine]

    def broadcast_object(self, value, src: int = 0):
        return value if self.rank == 0 else self.sent


def test_a_node_started_with_another_lr_is_refused_naming_the_option():
    node0, node1 = resolve(["--max-steps", "3"]), resolve(["--max-steps", "3", "--lr", "0.5"])
    message = (
        r"^rank 1 was started with --lr 0.5, rank 0 with --lr unset \(its default\); start "
        "every node"
    )
    for rank, mine, theirs in ((0, node0, node1), (1, node1, node0)):
        with pytest.raises(ValueError, match=message):  # the same line on either node
            check_same_options(mine, Ranks(rank, _values(theirs)))


def test_several_differences_are_counted_and_paths_and_threads_may_differ():
    node0 = resolve(["--output-dir", "/mnt/a/run", "--threads", "4"])
    node1 = resolve(["--output-dir", "/shared/run", "--threads", "8"])
    check_same_options(node0, Ranks(0, _values(node1)))  # one directory, mounted elsewhere
    other = resolve(["--max-steps", "6", "--seed", "1"])
    with pytest.raises(ValueError, match=r"6, rank 0 with --max-steps 2000 \(and 1 more"):
        check_same_options(node0, Ranks(0, _values(other)))


def test_a_node_that_cannot_see_rank_0s_run_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(same_job, "PROBE_WAIT_S", 0.05)
    local = tmp_path / "node1-disk"  # rank 1's --output-dir: not where rank 0 wrote
    name = same_job.PROBE_PREFIX + "0123"
    with pytest.raises(ValueError, match=r"^rank 1: the run directory .* every node shares"):
        check_shared_run_dir(local, Ranks(1, other=None, sent=name), 1, several_nodes=True)
    assert not local.exists()  # rank 1 writes nothing there


def test_rank_0_removes_its_probe_whatever_the_verdict(tmp_path):
    run_dir = tmp_path / "run"
    refused = ("ValueError", "no probe", None, None)
    for other in (refused, None):
        with pytest.raises(ValueError, match="rank 1: no probe") if other else nullcontext():
            check_shared_run_dir(run_dir, Ranks(0, other=other), 0, several_nodes=True)
        assert list(run_dir.iterdir()) == []


def test_one_node_writes_no_probe(tmp_path):
    check_shared_run_dir(tmp_path / "run", Ranks(0), 0, several_nodes=False)
    assert not (tmp_path / "run").exists()


def test_a_node_with_another_distzo_or_torch_is_refused_naming_it(monkeypatch):
    mine = same_job.software()
    assert mine["distzo"].endswith(f"(source {same_job.source_digest()})")
    same_job.check_same_software(Ranks(1, dict(mine)))  # the same install: no error
    other = dict(mine, distzo="0.1.0 (source 000000000000)")
    message = (
        r"^rank 1 runs distzo 0\.1\.0 \(source 000000000000\), rank 0 distzo .+; install the "
        "same distzo on every node$"
    )
    with pytest.raises(ValueError, match=message):
        same_job.check_same_software(Ranks(0, other))
    with pytest.raises(ValueError, match=r"^rank 1 runs torch 2\.0\.0, rank 0 torch "):
        same_job.check_same_software(Ranks(0, dict(mine, torch="2.0.0")))


def test_the_source_digest_changes_with_any_source_file(tmp_path, monkeypatch):
    package = tmp_path / "distzo"
    (package / "zo").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "zo" / "noise.py").write_text("A = 1\n")
    monkeypatch.setattr(same_job, "PACKAGE", package)
    same_job.source_digest.cache_clear()
    before = same_job.source_digest()
    (package / "zo" / "noise.py").write_text("A = 2\n")
    same_job.source_digest.cache_clear()
    assert same_job.source_digest() != before
    same_job.source_digest.cache_clear()


def test_a_node_whose_copy_of_a_data_file_holds_other_rows_is_refused_naming_it():
    # Each rank reads the files itself: a node's stale copy at the same path made its ranks
    # shard another global batch and score another evaluation set, with no error.
    job = resolve(["--task", "sst2", "--train-file", "data.jsonl", "--eval-file", "eval.jsonl"])
    rows = LoadedRows("sst2", ["a", "b"], ["c"])
    stale = LoadedRows("sst2", ["a", "B"], ["c"])
    same_job.check_same_rows(job, rows.digests, Ranks(1, same_job.rows_read(job, rows.digests)))
    message = (
        r"^rank 1 read other rows from --train-file data\.jsonl than rank 0 \(rows digest "
        r"[0-9a-f]{16}, rank 0's [0-9a-f]{16}\); give every node the same file$"
    )
    for rank, mine, theirs in ((0, rows, stale), (1, stale, rows)):  # one line on either node
        with pytest.raises(ValueError, match=message):
            read = same_job.rows_read(job, theirs.digests)
            same_job.check_same_rows(job, mine.digests, Ranks(rank, read))
    other_eval = LoadedRows("sst2", ["a", "b"], ["d"])
    with pytest.raises(ValueError, match=r"^rank 1 read other rows from --eval-file eval\.jsonl"):
        same_job.check_same_rows(
            job, rows.digests, Ranks(0, same_job.rows_read(job, other_eval.digests))
        )


def test_the_rows_digest_hashes_the_rows_json_a_chunk_at_a_time(monkeypatch):
    """The digest of a run's seed log (a resume compares it) stays the SHA-256 of
    ``json.dumps(rows)``, but a million rows are not one string held at once (360 MB on a
    90 MB file), nor each Example deep-copied (``astuple``: 6 s of the 9 s a digest took)."""
    import hashlib
    import json

    from distzo.data import task_data

    examples = [Example(f"p{i}", (" a", " b"), i % 2, ("x",) * (i % 3)) for i in range(7)]
    texts = [f"line {i} \u00e9" for i in range(7)]
    cases = (examples, texts, [])
    expected = [
        hashlib.sha256(json.dumps([_as_list(r) for r in rows]).encode()).hexdigest()[:16]
        for rows in cases
    ]
    encoded = []
    dumps = json.dumps
    monkeypatch.setattr(task_data, "DIGEST_CHUNK", 3, raising=False)
    monkeypatch.setattr(task_data.json, "dumps", lambda v: encoded.append(len(v)) or dumps(v))
    monkeypatch.setattr(task_data.dataclasses, "astuple", None)
    assert [rows_digest(rows) for rows in cases] == expected
    assert max(encoded) <= 3


def _as_list(row):
    """An Example as the JSON list of its fields, as ``dataclasses.astuple`` made it."""
    if isinstance(row, str):
        return row
    return [row.prompt, list(row.continuations), row.label, list(row.answers)]


class Gathers:
    """Rank 1 of two nodes: each gather hands it rank 0's next value beside its own."""

    distributed = True

    def __init__(self, *rank0s) -> None:
        self.rank0s = list(rank0s)

    def all_gather_object(self, mine):
        return [self.rank0s.pop(0), mine]


def test_claiming_a_run_across_nodes_refuses_a_nodes_stale_data_file(tmp_path, monkeypatch):
    """The check of each node's rows runs where a launch claims its run directory: the
    rows digests the trainer hands ``RunClaim.take`` reach it, across nodes."""
    monkeypatch.setattr(same_job, "check_same_software", lambda comm: None)
    monkeypatch.setattr(same_job, "check_shared_run_dir", lambda *args: None)
    job = resolve(["--task", "sst2", "--train-file", "d.jsonl", "--output-dir", str(tmp_path)])
    rows, stale = LoadedRows("sst2", ["a", "b"], ["c"]), LoadedRows("sst2", ["a", "B"], ["c"])
    comm = Gathers(_values(job), same_job.rows_read(job, rows.digests))
    env = LaunchEnv(rank=1, world_size=2, local_world_size=1, node_rank=1)
    with pytest.raises(ValueError, match=r"^rank 1 read other rows from --train-file d\.jsonl"):
        RunClaim.take(job, SimpleNamespace(comm=comm), env, stale.digests)


def _sst2(train: str, evals: str) -> Any:
    return resolve(["--task", "sst2", "--train-file", train, "--eval-file", evals])


def test_nodes_may_read_their_own_copies_of_the_data_at_paths_of_their_own():
    """torchtitan's and DeepSpeed's users stage the data on each node's local disk, at a
    path of that node's: on several nodes (where each node's rows are compared) the paths
    may differ; an hf: spec against a file is still another option."""
    node0 = _sst2("/scratch/node0/train.jsonl", "/scratch/node0/dev.jsonl")
    node1 = _sst2("/local/train.jsonl", "/local/dev.jsonl")
    for rank, mine, theirs in ((0, node0, node1), (1, node1, node0)):
        check_same_options(mine, Ranks(rank, _values(theirs)), node_data_paths=True)
    one_command = (
        r"^rank 1 was started with --train-file '/local/train\.jsonl', rank 0 with "
        r"--train-file '/scratch/node0/train\.jsonl' \(and 1 more options\); start every node"
    )
    with pytest.raises(ValueError, match=one_command):  # one node: its ranks share one line
        check_same_options(node0, Ranks(0, _values(node1)))
    hub = _sst2("hf:glue:sst2:train", "/local/dev.jsonl")
    message = (
        r"^rank 1 was started with --train-file 'hf:glue:sst2:train', rank 0 with "
        r"--train-file '/scratch/node0/train\.jsonl'; start every node with the same options$"
    )
    for rank, mine, theirs in ((0, node0, hub), (1, hub, node0)):
        with pytest.raises(ValueError, match=message):
            check_same_options(mine, Ranks(rank, _values(theirs)), node_data_paths=True)


def test_a_nodes_own_copy_holding_other_rows_is_named_by_both_paths_on_every_rank():
    node0 = _sst2("/scratch/train.jsonl", "/scratch/dev.jsonl")
    node1 = _sst2("/local/train.jsonl", "/local/dev.jsonl")
    rows, stale = LoadedRows("sst2", ["a", "b"], ["c"]), LoadedRows("sst2", ["a", "B"], ["c"])
    same_job.check_same_rows(node0, rows.digests, Ranks(0, same_job.rows_read(node1, rows.digests)))
    ours, theirs = rows.digests["--train-file"], stale.digests["--train-file"]
    message = (
        r"^rank 1 read other rows from --train-file /local/train\.jsonl than rank 0 from "
        rf"/scratch/train\.jsonl \(rows digest {theirs}, rank 0's {ours}\); give every node a "
        "copy of rank 0's file$"
    )
    with pytest.raises(ValueError, match=message):
        same_job.check_same_rows(
            node0, rows.digests, Ranks(0, same_job.rows_read(node1, stale.digests))
        )
    with pytest.raises(ValueError, match=message):
        same_job.check_same_rows(
            node1, stale.digests, Ranks(1, same_job.rows_read(node0, rows.digests))
        )


def test_claiming_a_run_across_nodes_takes_each_nodes_own_copy_of_the_same_rows(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(same_job, "check_same_software", lambda comm: None)
    monkeypatch.setattr(same_job, "check_shared_run_dir", lambda *args: None)
    run = ["--output-dir", str(tmp_path)]
    node0 = resolve(
        ["--task", "sst2", "--train-file", "/scratch/d.jsonl", "--eval-file", "e", *run]
    )
    node1 = resolve(["--task", "sst2", "--train-file", "/local/d.jsonl", "--eval-file", "e", *run])
    rows = LoadedRows("sst2", ["a", "b"], ["c"])
    rank0s = (_values(node0), same_job.rows_read(node0, rows.digests), None)  # None: locked
    env = LaunchEnv(rank=1, world_size=2, local_world_size=1, node_rank=1)
    claim = RunClaim.take(node1, SimpleNamespace(comm=Gathers(*rank0s)), env, rows.digests)
    assert claim.path == tmp_path
    one_node = LaunchEnv(rank=1, world_size=2, local_world_size=2, node_rank=0)
    with pytest.raises(ValueError, match=r"^rank 1 was started with --train-file '/local/d"):
        RunClaim.take(node1, SimpleNamespace(comm=Gathers(*rank0s)), one_node, rows.digests)


def test_the_rows_digest_follows_every_field_and_the_order_of_the_rows():
    a, b = Example("p", ("x", "y"), 0), Example("p", ("x", "y"), 1)
    digests = {rows_digest(r) for r in ([a, b], [b, a], [a, a], [a], ["p"], ["p", "q"])}
    assert len(digests) == 6
    assert rows_digest([a, b]) == rows_digest([Example("p", ("x", "y"), 0), b])


def _model_folder(path, tokenizer: str = "{}", weights: bytes = b"w" * 100):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "opt"}')
    (path / "tokenizer.json").write_text(tokenizer)
    (path / "model.safetensors").write_bytes(weights)
    (path / ".cache").mkdir()
    (path / ".cache" / "download.lock").write_text("a node's own")
    return path


def test_a_node_whose_model_folder_holds_another_tokenizer_is_refused_naming_it(tmp_path):
    # Each node reads its own copy of --model: node 1's other tokenizer turned the same rows
    # into other token ids (step 0's g 9.23 where both nodes alike gave -0.348), no error.
    node0 = _model_folder(tmp_path / "node0")
    node1 = _model_folder(tmp_path / "node1", tokenizer='{"a": 1}')
    env = LaunchEnv(rank=1, world_size=2, local_world_size=1, node_rank=1)
    rank0s = same_job.folder_digests(node0)
    same_job.check_same_model("m", node0, Gathers(None, rank0s), env)  # a node's cache aside
    message = (
        r"^rank 1 read another model from --model m than rank 0: its tokenizer\.json differs "
        "from rank 0's; give every node the same model folder$"
    )
    with pytest.raises(ValueError, match=message):
        same_job.check_same_model("m", node1, Gathers(None, rank0s), env)
    (node1 / "tokenizer.json").unlink()
    (node1 / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"its config\.json differs from rank 0's \(and 1 more"):
        same_job.check_same_model("m", node1, Gathers(None, rank0s), env)
    one_node = LaunchEnv(rank=1, world_size=2, local_world_size=2, node_rank=0)
    same_job.check_same_model("m", node1, Gathers(None, rank0s), one_node)  # one folder


def test_a_file_one_node_lacks_or_alone_holds_is_named_from_either_side(tmp_path):
    """A file only rank 1's folder holds counts as much as one it lacks: each is named, as
    missing or as not in rank 0's folder, whichever file rank 0 lists first."""
    node0 = _model_folder(tmp_path / "node0")
    node1 = _model_folder(tmp_path / "node1")
    (node1 / "added.json").write_text("{}")
    env = LaunchEnv(rank=1, world_size=2, local_world_size=1, node_rank=1)
    rank0s = same_job.folder_digests(node0)
    with pytest.raises(ValueError, match=r"its added\.json is not in rank 0's folder; give"):
        same_job.check_same_model("m", node1, Gathers(None, rank0s), env)
    (node1 / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"its tokenizer\.json is missing \(and 1 more files\)"):
        same_job.check_same_model("m", node1, Gathers(None, rank0s), env)


def test_a_stale_data_file_is_refused_with_each_ranks_own_digest():
    job = resolve(["--task", "sst2", "--train-file", "data.jsonl"])
    rows, stale = LoadedRows("sst2", ["a", "b"], []), LoadedRows("sst2", ["a", "B"], [])
    ours, theirs = rows.digests["--train-file"], stale.digests["--train-file"]
    message = rf"\(rows digest {theirs}, rank 0's {ours}\)"
    with pytest.raises(ValueError, match=message):  # rank 0 holds rows, rank 1 the stale copy
        same_job.check_same_rows(
            job, rows.digests, Ranks(0, same_job.rows_read(job, stale.digests))
        )


def test_a_large_checkpoint_is_digested_by_its_size_and_pieces_across_it(tmp_path, monkeypatch):
    monkeypatch.setattr(same_job, "WHOLE_BYTES", 1000)
    monkeypatch.setattr(same_job, "SAMPLE", 10)
    weights = bytes(range(256)) * 40  # 10240 bytes: 32 pieces of 10, one every ~330
    path = tmp_path / "model.safetensors"
    path.write_bytes(weights)
    digest = same_job.file_digest(path)
    path.write_bytes(weights[:5000] + b"x" + weights[5001:])  # between two pieces
    assert same_job.file_digest(path) == digest
    for at in (0, 4950, len(weights) - 1):  # the header, a piece inside, the last byte
        path.write_bytes(weights[:at] + b"x" + weights[at + 1 :])
        assert same_job.file_digest(path) != digest, at
    path.write_bytes(weights + b"x")
    assert same_job.file_digest(path) != digest


def test_a_model_one_rank_fails_to_build_or_save_fails_every_rank(tmp_path):
    # Rank 0 alone writes the default model's base/: its full disk ended rank 0, and node
    # 1's ranks learned of it only from their next collective, with no word of the cause.
    job = resolve(["--max-steps", "1", "--output-dir", str(tmp_path)])
    env = LaunchEnv(rank=1, world_size=2, local_world_size=1, node_rank=1)
    full = ("OSError", "No space left on device", 28, str(tmp_path / "base"))
    with pytest.raises(OSError, match=r"^\[Errno 28\] rank 0: No space left on device") as err:
        run_model(job, 0, env, Gathers(full), tmp_path)
    assert err.value.filename == str(tmp_path / "base")


def test_a_run_names_its_base_by_an_absolute_path_and_a_resume_leaves_base_as_it_is(
    tmp_path, monkeypatch
):
    """An exported adapter names the model's name_or_path as its base: relative, it loads
    only from the directory the run started in. A resume must not write base/ again (the
    replay starts from it; a resume killed mid-write would leave it half-written). base/
    holds the byte tokenizer a text task read with."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from tests.helpers.models import build

    monkeypatch.chdir(tmp_path)
    alone, env = SimpleNamespace(distributed=False), LaunchEnv(rank=0, world_size=1)

    def model(*args: str, resume: str = "no"):
        job = resolve(["--max-steps", "1", "--output-dir", "run", *args])
        job.run.resume = resume  # as the launch's checks resolve it
        return run_model(job, 0, env, alone, Path("run"))[0]

    assert model("--task", "sst2").name_or_path == str(tmp_path / "run" / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "base")
    assert tokenizer.decode(tokenizer.encode("hi", add_special_tokens=False)) == "hi"
    weights = tmp_path / "run" / "base" / "model.safetensors"
    weights.write_bytes(b"as the first session left it")  # a rewrite would replace it
    assert model(resume="yes").name_or_path == str(tmp_path / "run" / "base")
    assert weights.read_bytes() == b"as the first session left it"
    build("llama", seed=0).save_pretrained("local")  # --model given relative to the cwd
    assert model("--model", "local").name_or_path == str(tmp_path / "local")


def test_the_default_models_init_follows_the_seed_alone_not_the_processs_draws(tmp_path):
    """Every rank builds the default model itself: its init must agree across ranks (and
    with the run's base/) whatever each process drew from torch's generator before."""
    import torch

    env = LaunchEnv(rank=1, world_size=2, launched=True)  # writes no base/
    alone: Any = SimpleNamespace(distributed=False)  # one rank's collectives

    def init(seed: int) -> dict:
        torch.rand(7)  # a process's own earlier draws
        job = resolve(["--max-steps", "1", "--output-dir", str(tmp_path)])
        job.run.resume = "no"
        return run_model(job, seed, env, alone, tmp_path)[0].state_dict()

    first, again, other = init(5), init(5), init(6)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_a_hub_snapshot_that_differs_between_nodes_names_the_download_to_redo(tmp_path):
    # every node reads rank 0's commit of a hub name: copies of it differ only where one
    # node's download is partial or damaged, which "the same model folder" did not say
    commit = "c" * 40
    snapshots = tmp_path / "node0" / "models--org--m" / "snapshots"
    snapshots.mkdir(parents=True)
    node0 = _model_folder(snapshots / commit)
    node1_snapshots = tmp_path / "node1" / "models--org--m" / "snapshots"
    node1_snapshots.mkdir(parents=True)
    node1 = _model_folder(node1_snapshots / commit, weights=b"torn")
    env = LaunchEnv(rank=1, world_size=2, local_world_size=1, node_rank=1)
    message = (
        r"^rank 1 read another model from --model org/m than rank 0: its model\.safetensors "
        rf"differs from rank 0's; one node's download of commit {commit} is partial or "
        rf"damaged; on the node whose copy is wrong: hf download org/m --revision {commit} "
        "--force-download$"
    )
    rank0s = same_job.folder_digests(node0)
    with pytest.raises(ValueError, match=message):
        same_job.check_same_model("org/m", node1, Gathers(None, rank0s), env)
