"""An ``hf:`` source at a revision (``hf:PATH@REVISION[:CONFIG]:SPLIT``: a tag, a branch or
a commit), resolved to one commit by rank 0 and read at it on every node; the commit each
source was read at recorded in the seed log, and read back by a resume after the
dataset's main moved (which was refused: "restore the file the run started with")."""

import json
import time

import pytest
import torch.distributed as dist

from distzo.config.job import resolve
from distzo.data.hub_spec import HubSpec, hub_spec
from distzo.data.loaders import parse_hub_spec
from distzo.dist import LaunchEnv, launch_gate
from distzo.job.validation import task_rows
from tests.helpers import stand_in_hub as hub
from tests.helpers.launch import train_in_process
from tests.helpers.stand_in_hub import (
    COMMIT,
    NEW_COMMIT,
    OLD_COMMIT,
    OLD_ROWS,
    stand_in_hub,
)
from tests.unit.test_hub_dataset_per_rank import place

TAGGED = ["--task", "sst2", "--train-file", "hf:org/tiny@v1:train"]
TAGGED += ["--eval-file", "hf:org/tiny:validation"]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """The launcher's store every rank reaches."""
    shared = dist.HashStore()
    monkeypatch.setattr(launch_gate, "rendezvous_store", lambda env, timeout: shared)
    return shared


def sentences(rows) -> list[str]:
    """The sentence each example's prompt begins with."""
    return [example.prompt.split(" It was")[0] for example in rows]


def test_a_spec_names_a_revision_after_the_first_at():
    assert hub_spec("hf:org/tiny@v1:train") == HubSpec("org/tiny", None, "train", "v1")
    assert hub_spec(f"hf:org/tiny@{COMMIT}:cfg:test") == HubSpec("org/tiny", "cfg", "test", COMMIT)
    assert hub_spec("hf:org/tiny@refs/pr/1:train").revision == "refs/pr/1"
    assert hub_spec("hf:imdb:test") == HubSpec("imdb", None, "test", None)
    assert parse_hub_spec("hf:org/tiny@v1:cfg:train") == ("org/tiny", "cfg", "train")


@pytest.mark.parametrize(
    "spec, line",
    [
        (
            "hf:org/tiny@:train",
            "hf:org/tiny@:train: the revision after @ is empty; write "
            "hf:PATH[@REVISION][:CONFIG]:SPLIT (a tag, a branch or a commit), or drop the @",
        ),
        (
            "hf:@v1:train",
            "hf:@v1:train: the name before @ is empty; write hf:PATH[@REVISION][:CONFIG]:SPLIT "
            "(a tag, a branch or a commit), or drop the @",
        ),
        (
            "hf:org/tiny@v1@v2:train",
            "hf:org/tiny@v1@v2:train: a hub dataset's name holds no @ and a spec names one "
            "revision; write hf:PATH[@REVISION][:CONFIG]:SPLIT",
        ),
    ],
)
def test_an_empty_or_doubled_revision_is_one_line(spec, line):
    with pytest.raises(ValueError) as raised:
        hub_spec(spec)
    assert str(raised.value) == line


def test_a_local_folder_with_an_at_is_the_folder_or_refused_as_ambiguous(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "clone@v1").mkdir()
    (tmp_path / "tiny@v1").mkdir()
    (tmp_path / "clone").mkdir()
    folder = f"{tmp_path}/clone@v1"  # an absolute path is no hub name: the folder
    assert hub_spec(f"hf:{folder}:train") == HubSpec(folder, None, "train", None)
    assert hub_spec("hf:./tiny@v1:train") == HubSpec("./tiny@v1", None, "train", None)
    with pytest.raises(ValueError) as ambiguous:
        hub_spec("hf:tiny@v1:train")
    assert str(ambiguous.value) == (
        "hf:tiny@v1:train: tiny@v1 is a local folder, and also reads as hub dataset tiny at "
        "revision v1; write hf:./tiny@v1:... for the folder, or run where no such folder is"
    )
    with pytest.raises(ValueError) as of_folder:
        hub_spec("hf:clone@v2:train")
    assert str(of_folder.value) == (
        "hf:clone@v2:train: clone is a local folder, which has no revision; drop @v2 (check "
        "the revision out in the folder)"
    )


def test_a_tag_is_resolved_by_rank_0_and_read_at_its_commit_on_every_node(
    store, monkeypatch, tmp_path
):
    """The train split at tag v1 (OLD_COMMIT), the validation split at main (COMMIT), one
    dataset: each revision asked once, by rank 0; node 1 downloads by commit alone."""
    import datasets.config
    from huggingface_hub import constants

    job = resolve(TAGGED)
    with stand_in_hub(monkeypatch, tmp_path / "node0") as requests:
        by_rank = [task_rows(job, place(0))]
        asked = list(requests)
        by_rank.append(task_rows(job, place(1)))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "node1"))
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "node1" / "ds")
        by_rank.append(task_rows(job, place(2)))
        node_1 = requests[len(asked) :]
    assert asked.count("GET /api/datasets/org/tiny/revision/v1") == 1
    assert asked.count("GET /api/datasets/org/tiny") == 1  # main's question
    resolved = [r for r in node_1 if "/resolve/" in r or "/tree/" in r]
    assert resolved and all(OLD_COMMIT in r or COMMIT in r for r in resolved)
    assert not [r for r in node_1 if "/v1" in r or "/main" in r]
    for rows in by_rank:
        assert rows is not None and sentences(rows.train) == [r["sentence"] for r in OLD_ROWS]
        assert rows.commits == {"--train-file": OLD_COMMIT, "--eval-file": COMMIT}
        assert rows.digests == by_rank[0].digests


def test_one_process_reads_a_commit_named_by_its_sha_and_records_it(monkeypatch, tmp_path):
    job = resolve(["--task", "sst2", "--train-file", f"hf:org/tiny@{OLD_COMMIT}:train"])
    job.data.eval_file = "hf:org/tiny:validation"
    with stand_in_hub(monkeypatch, tmp_path):
        rows = task_rows(job, LaunchEnv())
    assert rows is not None and sentences(rows.train) == [r["sentence"] for r in OLD_ROWS]
    assert rows.commits == {"--train-file": OLD_COMMIT, "--eval-file": COMMIT}


def silent(monkeypatch) -> None:
    """The hub answers nothing from now on (a firewall)."""
    from huggingface_hub import constants

    from distzo.models import hub_reads

    monkeypatch.setitem(hub_reads.SILENT_SINCE, constants.ENDPOINT, time.monotonic())


def test_a_silent_hub_reads_a_named_commits_copy_and_refuses_a_tag(monkeypatch, tmp_path):
    job = resolve(["--task", "sst2", "--train-file", f"hf:org/tiny@{OLD_COMMIT}:train"])
    job.data.eval_file = job.data.train_file
    with stand_in_hub(monkeypatch, tmp_path) as requests:
        assert task_rows(job, LaunchEnv()) is not None  # the cache holds OLD_COMMIT's copy
        silent(monkeypatch)
        asked = list(requests)
        rows = task_rows(job, LaunchEnv())
        job.data.train_file = job.data.eval_file = "hf:org/tiny@v1:train"
        with pytest.raises(ValueError) as tag:
            task_rows(job, LaunchEnv())
        job.data.train_file = job.data.eval_file = f"hf:org/tiny@{NEW_COMMIT}:train"
        with pytest.raises(ValueError) as uncached:
            task_rows(job, LaunchEnv())
        assert requests == asked
    assert rows is not None and rows.commits["--train-file"] == OLD_COMMIT
    assert str(tag.value) == (
        "hf:org/tiny@v1:train: the hub did not answer about revision v1, and the datasets "
        "cache cannot say which commit a tag or branch names; run with the hub reachable, or "
        "name a commit the cache holds a copy of (hf:org/tiny@COMMIT:train)"
    )
    assert str(uncached.value).startswith(
        f"hf:org/tiny@{NEW_COMMIT}:train: the hub did not answer about revision {NEW_COMMIT}, "
        "and the datasets cache holds no copy at that commit; "
    )


def test_an_unknown_revision_is_named_with_the_fix(monkeypatch, tmp_path):
    job = resolve(["--task", "sst2", "--train-file", "hf:org/tiny@v9:train"])
    job.data.eval_file = job.data.train_file
    with stand_in_hub(monkeypatch, tmp_path), pytest.raises(ValueError) as raised:
        task_rows(job, LaunchEnv())
    assert str(raised.value) == (
        "hf:org/tiny@v9:train: org/tiny has no revision 'v9' (a tag, branch or commit of its "
        "repository); name one it has, or leave @v9 out to read its main"
    )


RUN = ["--task", "sst2", "--train-file", "hf:org/tiny:train"]
RUN += ["--eval-file", "hf:org/tiny:validation", "--batch-size", "2", "--eval-batch-size", "2"]
RUN += ["--log-every", "0"]


def header_of(run) -> dict:
    return json.loads((run / "seedlog.jsonl").read_text().splitlines()[0])


def summary_of(run) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_a_resume_after_main_moved_reads_the_commit_the_run_started_with(monkeypatch, tmp_path):
    run = tmp_path / "run"
    argv = [*RUN, "--output-dir", str(run), "--max-steps", "2", "--save-steps", "1"]
    with stand_in_hub(monkeypatch, tmp_path / "hub"):
        first = train_in_process([*argv[:-4], "--max-steps", "1", "--save-steps", "1"])
        assert first.returncode == 0, first.stderr[-2000:]
        header = header_of(run)
        first_summary = summary_of(run)
        monkeypatch.setitem(hub.REFS, "main", NEW_COMMIT)  # main moves on
        resumed = train_in_process([*argv, "--resume"])
        resumed_summary = summary_of(run)
        tagged = train_in_process([*argv, "--resume", "--train-file", "hf:org/tiny@v1:train"])
        named = train_in_process([*argv[:-4], "--max-steps", "3", "--resume"])
        by_sha = [*argv[:-4], "--max-steps", "4", "--resume"]
        by_sha[3] = f"hf:org/tiny@{COMMIT}:train"
        named_commit = train_in_process(by_sha)
        fresh = train_in_process(
            [*RUN, "--output-dir", str(tmp_path / "fresh"), "--max-steps", "1"]
        )
    assert header["data_commits"] == {
        "--train-file": {"source": "hf:org/tiny:train", "commit": COMMIT},
        "--eval-file": {"source": "hf:org/tiny:validation", "commit": COMMIT},
    }
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (
        f"--resume: --train-file hf:org/tiny:train is read at commit {COMMIT}, the one the run "
        "started with, not at the hub's newest"
    ) in resumed.stderr
    assert header_of(run)["data_commits"] == header["data_commits"]
    # summary.json lists the commit each source was read at, the resume's the run's
    read_at = {"hf:org/tiny:train": COMMIT, "hf:org/tiny:validation": COMMIT}
    assert first_summary["options"]["data_commits"] == read_at
    assert resumed_summary["options"]["data_commits"] == read_at
    assert tagged.returncode == 2
    assert tagged.stderr.strip().splitlines()[-1] == (
        "error: --resume: --train-file hf:org/tiny@v1:train names revision v1, and the run in "
        f"{run} trained on hf:org/tiny:train at commit {COMMIT}; give --train-file "
        "hf:org/tiny:train (the run's commit is read), or start afresh with --overwrite or "
        "another --output-dir"
    )
    assert named.returncode == 0, named.stderr[-2000:]
    assert named_commit.returncode == 0, named_commit.stderr[-2000:]  # the run's commit, named
    # a fresh run reads the hub's main now, and records it
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert header_of(tmp_path / "fresh")["data_commits"]["--train-file"]["commit"] == NEW_COMMIT
    assert summary_of(tmp_path / "fresh")["options"]["data_commits"] == {
        "hf:org/tiny:train": NEW_COMMIT,
        "hf:org/tiny:validation": NEW_COMMIT,
    }


def test_a_resumed_launch_reads_the_recorded_commit_on_every_node_asking_none(
    store, monkeypatch, tmp_path
):
    """main moved to NEW_COMMIT: the resume's ranks read COMMIT, the run's, which each
    node's first rank downloads; no rank 0 question which commit the dataset is now, and
    none about main (each node's first rank asked about it, then read another commit). A
    node whose cache holds the copy of COMMIT asks nothing at all."""
    import datasets.config
    from huggingface_hub import constants

    from tests.helpers.stand_in_hub import ROWS

    job = resolve(["--task", "sst2", "--train-file", "hf:org/tiny:train"])
    job.data.eval_file = "hf:org/tiny:validation"
    recorded = {job.data.train_file: COMMIT, job.data.eval_file: COMMIT}
    with stand_in_hub(monkeypatch, tmp_path / "node0") as requests:
        monkeypatch.setitem(hub.REFS, "main", NEW_COMMIT)
        by_rank = [task_rows(job, place(rank), resumed=recorded) for rank in (0, 1)]
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "node1"))
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "node1" / "ds")
        by_rank.append(task_rows(job, place(2), resumed=recorded))
        asked = list(requests)
        by_rank.append(task_rows(job, place(2), resumed=recorded))  # a requeue on node 1
        assert requests == asked
    # each node's first rank asks whether the hub answers about the recorded commit (its
    # reachability probe), as datasets' download does, and never about main; every
    # download is of that commit
    api = [r for r in requests if r.startswith("GET /api/datasets/org/tiny")]
    assert api and all(COMMIT in r for r in api)
    assert "GET /api/datasets/org/tiny" not in requests
    assert not [r for r in requests if "/main" in r or NEW_COMMIT in r]
    downloads = [r for r in requests if r.startswith("GET /datasets/org/tiny/resolve/")]
    assert downloads and all(COMMIT in r for r in downloads)
    for rows in by_rank:
        assert rows is not None and sentences(rows.train) == [r["sentence"] for r in ROWS]
        assert rows.commits == {"--train-file": COMMIT, "--eval-file": COMMIT}


def test_a_damaged_record_of_the_commits_is_one_line(tmp_path):
    from distzo.job.hub_data_commits import recorded_data_commits

    header = {"kind": "header", "data_commits": {"--train-file": {"source": "hf:x:train"}}}
    (tmp_path / "seedlog.jsonl").write_text(json.dumps(header) + "\n")
    with pytest.raises(ValueError) as raised:
        recorded_data_commits(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path / 'seedlog.jsonl'}: its header's data_commits "
        "{'--train-file': {'source': 'hf:x:train'}} does not name a source and a commit hash "
        "(40 hex digits) by flag; is the log damaged?"
    )
