"""``python -m tests.helpers.faulty_train ARGS``: ``python -m distzo.train ARGS`` with the
failures the environment names (``tests.helpers.faults``) injected."""

import sys

from distzo.train import main
from tests.helpers.faults import Faults

if __name__ == "__main__":
    sys.exit(main(callbacks=[Faults()]))
