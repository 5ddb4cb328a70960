"""``python -m cli ...`` (the same as the ``qtts`` console script)."""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main())
