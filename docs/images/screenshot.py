"""A headless Chromium screenshot of a secured stack's UI, signed in as a user of the stack.

    set -a; . ./viewer.env; set +a        # `mllm-pipeline stack worker-env --user NAME`
    python docs/images/screenshot.py https://127.0.0.1:4200/runs prefect-ui.png

The credential goes in an Authorization header set through Chrome's DevTools protocol, never in
the URL (MLflow's UI builds its API calls from the page's URL, and a browser refuses to fetch a
URL that holds a password); the browser trusts the stack's server certificate by its key only
(`--ignore-certificate-errors-spki-list`), and its background traffic to Google is off."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from websockets.sync.client import connect

QUIET = ["--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-default-apps", "--disable-domain-reliability", "--metrics-recording-only"]


def spki(url: str, ca: str) -> str:
    """The base64 SHA-256 of the public key of the server's certificate, which must verify
    against `ca`: the one key the browser is told to take."""
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port or 443
    with socket.create_connection((host, port), timeout=10) as raw, \
            ssl.create_default_context(cafile=ca).wrap_socket(raw, server_hostname=host) as tls:
        cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    der = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


def shoot(url: str, out: str, ca: str, wait: float = 15.0) -> None:
    user, secret = os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
    header = "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                    f"--user-data-dir={profile}", "--remote-debugging-port=0", "--window-size=1400,900",
                                    f"--ignore-certificate-errors-spki-list={spki(url, ca)}", *QUIET, "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text().strip():
                if time.monotonic() > deadline:
                    raise RuntimeError("chromium did not open its DevTools port")
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            pages = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
            with connect(ws_url, max_size=None) as ws:
                counter = iter(range(1, 1000))

                def call(method: str, **params) -> dict:
                    n = next(counter)
                    ws.send(json.dumps({"id": n, "method": method, "params": params}))
                    while True:
                        answer = json.loads(ws.recv(timeout=60))
                        if answer.get("id") == n:
                            return answer.get("result", {})

                call("Network.enable")
                call("Network.setExtraHTTPHeaders", headers={"Authorization": header})
                call("Page.navigate", url=url)
                time.sleep(wait)
                shot = call("Page.captureScreenshot", format="png")
            Path(out).write_bytes(base64.b64decode(shot["data"]))
        finally:
            browser.terminate()
            browser.wait(30)


if __name__ == "__main__":
    shoot(sys.argv[1], sys.argv[2], os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
