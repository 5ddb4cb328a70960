"""Container health check: exit 0 when GET /healthz on this container's port answers 200.

The slim runtime image has no curl; the base image's python3 runs this (standard library only).
The port is $QTTS_PORT (default 8000); the address is loopback whatever QTTS_HOST is.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("QTTS_PORT") or "8000"
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            ok = r.status == 200
    except (urllib.error.URLError, OSError) as e:
        print(f"healthcheck: {url}: {e}", file=sys.stderr)
        return 1
    if not ok:
        print(f"healthcheck: {url}: status {r.status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
