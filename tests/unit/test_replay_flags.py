"""``distzo.replay``'s export flags, which it takes from ``distzo.train``: what its --help
says of them, where the replay means them otherwise than training does."""

import pytest

from distzo.replay import main


def test_the_replays_help_gives_the_runs_export_options_as_its_defaults(capsys, monkeypatch):
    """A replay merges and shards as the run's export did: its --help must not say train's
    defaults (False, 5GB), which would tell a user that a --merge-adapter run replays
    unmerged, or a --export-shard-size 1GB run into 5GB files."""
    monkeypatch.setenv("COLUMNS", "1000")  # each flag's help on one line, as written
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    merge = text[text.index("--merge-adapter, --no-merge-adapter") :]
    assert merge.startswith(
        "--merge-adapter, --no-merge-adapter write an adapter run's base with the adapter "
        "merged in, or (--no-merge-adapter) the peft adapter alone (default: as the run's "
        "export, which its --merge-adapter decided)"
    )
    assert "(default: False)" not in text
    shards = text[text.index("--export-shard-size SIZE largest") :]
    assert shards.startswith(
        "--export-shard-size SIZE largest safetensors file of the exported model (e.g. 5GB, "
        "500MB) (default: as the run's export, which its --export-shard-size decided)"
    )
    assert "(default: 5GB)" not in text
