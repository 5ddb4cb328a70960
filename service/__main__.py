"""``python -m service serve ...`` (the same as ``qtts serve``)."""

import sys

from service.cli import main

if __name__ == "__main__":
    sys.exit(main())
