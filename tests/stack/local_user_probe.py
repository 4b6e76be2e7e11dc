"""Run by tests/stack/test_stack_policy.py as a second, unprivileged user of the stack's machine:
what issue 62's item 4 did (the servers straight, or a write through the proxy with no
credential). Argument: JSON {"sockets": {name: path}, "ports": [port, ...]}; prints JSON."""

import json
import socket
import ssl
import sys
import urllib.error
import urllib.request

given, out = json.loads(sys.argv[1]), {}
for name, path in given["sockets"].items():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
for port in given["ports"]:
    req = urllib.request.Request(
        f"https://127.0.0.1:{port}/api/work_pools/local",
        method="PATCH",
        data=b'{"concurrency_limit": 5}',
        headers={"Content-Type": "application/json"},
    )
    try:
        out[str(port)] = urllib.request.urlopen(req, context=ctx, timeout=30).status
    except urllib.error.HTTPError as e:
        out[str(port)] = e.code
print(json.dumps(out))
