"""A benchmark report's provenance: the commit it names is the code that ran."""

import subprocess

from distzo.bench.records import git_commit


def git(root, *args):
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(command, cwd=root, check=True, capture_output=True, text=True).stdout


def test_the_commit_says_dirty_when_the_tree_that_ran_is_not_heads(tmp_path):
    """A copied working tree with uncommitted changes once reported the older HEAD alone
    (benchmarks/RESULTS.md, second H100 batch)."""
    git(tmp_path, "init", "-q")
    (tmp_path / "bench.py").write_text("x = 1\n")
    git(tmp_path, "add", "bench.py")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "--short", "HEAD").strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "bench.py").write_text("x = 2\n")  # a tracked file changed
    assert git_commit(tmp_path) == f"{head}-dirty"
    git(tmp_path, "checkout", "-q", "bench.py")
    (tmp_path / "new.py").write_text("y = 1\n")  # a file git does not ignore, not committed
    assert git_commit(tmp_path) == f"{head}-dirty"
    (tmp_path / ".gitignore").write_text("new.py\n.gitignore\n")  # ignored: HEAD's tree ran
    assert git_commit(tmp_path) == head


def test_outside_git_the_commit_is_unknown(tmp_path):
    assert git_commit(tmp_path / "nowhere") == "unknown"


def test_an_installed_copy_inside_a_checkout_names_no_commit(tmp_path):
    """A non-editable install in a virtualenv kept in the checkout (.venv/lib/python3.11/
    site-packages/distzo) reported the checkout's HEAD, though the installed code may be
    another commit's."""
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    git(tmp_path, "add", ".gitignore")
    git(tmp_path, "commit", "-q", "-m", "one")
    installed = tmp_path / ".venv" / "lib" / "python3.11"
    installed.mkdir(parents=True)
    assert git_commit(tmp_path) != "unknown"
    assert git_commit(installed) == "unknown"


def test_a_timer_leaves_its_warmup_calls_untimed():
    import torch

    from distzo.bench.timing import time_repeated

    calls = []
    timer = time_repeated(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=2)
    assert len(calls) == 5 and len(timer.samples) == 3
