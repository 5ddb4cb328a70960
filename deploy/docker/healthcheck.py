"""Container health check: exit 0 when GET /readyz on this container's port answers 200.

Healthy means ready: the model is loaded and every worker is warm and alive (and the server is
not draining). A server that answers HTTP while its workers crash-loop is unhealthy, and the
reason /readyz gives (the last worker start error) is printed for `docker inspect`.
The slim runtime image has no curl; the base image's python3 runs this (standard library only).
The port is $QTTS_PORT (default 8000); the address is loopback whatever QTTS_HOST is.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("QTTS_PORT") or "8000"
    url = f"http://127.0.0.1:{port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            return 0 if r.status == 200 else 1
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read() or b"{}")
        except ValueError:
            body = {}
        why = body.get("last_error") or body.get("status") or "not ready"
        print(f"healthcheck: {url}: {e.code} {why}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"healthcheck: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
