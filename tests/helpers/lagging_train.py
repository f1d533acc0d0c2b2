"""``python -m tests.helpers.lagging_train ARGS``: ``python -m distzo.train ARGS`` where one
rank's node lists the run's checkpoints late, as an NFS client with a stale directory
cache does: ``DISTZO_LAG=RANK:STEPS`` hides from that rank's listings every checkpoint of
more than STEPS steps (-1: all of them)."""

import os
import sys

import distzo.job.checkpoint as checkpoint
from distzo.train import main

LAG = "DISTZO_LAG"
_listed = checkpoint._complete


def _lagging(directory):
    """The listing this rank's node shows: the newer checkpoints not yet there."""
    rank, steps = (int(x) for x in os.environ[LAG].split(":"))
    complete = _listed(directory)
    if os.environ.get("RANK") != str(rank):
        return complete
    return [(n, path) for n, path in complete if n <= steps]


checkpoint._complete = _lagging

if __name__ == "__main__":
    sys.exit(main())
