"""Object storage as users meet it, each through the real CLI against moto's S3 server on
loopback: a bucket that does not exist, credentials that are missing or refused, a store that
hangs instead of dying. Each ends in one `error:` line, exit status 2, and nothing made."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import prewarmed
import pytest
from servers import run_s3_server
from textdata import make_text

# The read timeout a hung store is waited out with (mllm.storage reads MLLM_S3_READ_TIMEOUT): the
# production 10 s would only make the tests wait longer for the same fact.
READ_S = 3.0

pytestmark = pytest.mark.integration

BUCKET = "mllm-objects"
SECRET = "wrongSecretKey-Zq8v1xNn4"
# Short trainings that checkpoint often: long enough to stop the store in the middle.
LONG = [
    "train.max_steps=3000",
    "train.eval_interval=100",
    "train.checkpoint_interval=50",
    "train.log_interval=10",
    "sample.max_new_tokens=20",
]


def cli(*args: str, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return prewarmed.run("flows.cli", list(args), _env(env), timeout=timeout)


def _env(env: dict[str, str]) -> dict[str, str]:
    # No AWS variable of the test process's own: each test says which credentials it gives.
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**base, "COLUMNS": "200", "AWS_EC2_METADATA_DISABLED": "true", **env}


def one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == out.stderr.strip().splitlines()[-1], out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with run_s3_server(tmp_path_factory.mktemp("s3")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def stores(tmp_path: Path) -> dict[str, str]:
    """A Prefect home and an MLflow store of this test's own, and a corpus."""
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "corpus.txt").write_text(make_text(3000), encoding="utf-8")
    # No Prefect server named: the checks below prove that none started (`_nothing_started`).
    return {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}",
        "PREFECT_API_URL": "",
    }


def on_session_server(stores: dict[str, str]) -> dict[str, str]:
    """The same stores for a command that runs its stages: on the session's Prefect server
    (conftest.prefect_server), a command forked from the prewarmed process, rather than a new
    interpreter that starts a temporary server (its database alone is about 6 s of CPU). Such a
    command has nothing to prove about Prefect's start."""
    return {k: v for k, v in stores.items() if k != "PREFECT_API_URL"}


def _nothing_started(tmp_path: Path) -> None:
    """Neither Prefect's temporary server nor the MLflow store was made: the check came first."""
    assert not list((tmp_path / "prefect").rglob("*.db")), "Prefect started"
    assert not list((tmp_path / "mlflow").iterdir()), "an MLflow store was made"


def test_a_missing_bucket_is_one_line_before_prefect_starts_and_is_not_created(s3, stores, tmp_path):
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(tmp_path / "corpus.txt"),
        "--storage",
        "s3://nobucket2/x",
        env={**s3.env, **stores},
    )
    one_line_error(out, "bucket nobucket2 does not exist: create it or choose another --storage")
    assert "nobucket2" not in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}
    _nothing_started(tmp_path)


def test_no_credentials_for_the_storage_root_name_where_they_are_read(s3, stores, tmp_path):
    env = {
        **s3.env,
        **stores,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
    }
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    out = cli(
        "run", "--recipe", "smoke", "--source", str(tmp_path / "corpus.txt"), "--storage", f"s3://{BUCKET}/x", env=env
    )
    one_line_error(out, f"no credentials for s3://{BUCKET}/x", "AWS_ACCESS_KEY_ID", "~/.aws/credentials")
    _nothing_started(tmp_path)
    assert "Contents" not in s3.client().list_objects_v2(Bucket=BUCKET, Prefix="x/")


@pytest.fixture(scope="module")
def s3_checking_keys(tmp_path_factory):
    """moto checking credentials after its first requests, which make a bucket holding a corpus
    and a user whose keys may use it; those keys, as AWS variables."""
    with run_s3_server(tmp_path_factory.mktemp("s3-auth"), env={"INITIAL_NO_AUTH_ACTION_COUNT": "5"}) as server:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=server.direct_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        server.client().create_bucket(Bucket=BUCKET)
        server.client().put_object(Bucket=BUCKET, Key="corpus.txt", Body=make_text(3000).encode())
        iam.create_user(UserName="trainer")
        iam.put_user_policy(
            UserName="trainer",
            PolicyName="s3",
            PolicyDocument=(
                '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
            ),
        )
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        yield (
            server,
            {**server.env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]},
        )


def test_refused_credentials_are_one_line_for_the_storage_root_and_for_an_s3_source(s3_checking_keys, stores, tmp_path):
    server, good = s3_checking_keys
    wrong = {**good, **stores, "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": SECRET}
    out = cli(
        "run", "--recipe", "smoke", "--source", str(tmp_path / "corpus.txt"), "--storage", f"s3://{BUCKET}/x", env=wrong
    )
    line = one_line_error(
        out,
        f"the credentials for s3://{BUCKET}/x were refused (InvalidAccessKeyId",
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment",
    )
    assert SECRET not in out.stdout + out.stderr and "local copy" not in line
    _nothing_started(tmp_path)

    # The same keys on an S3 source: the same advice, not "pass a local copy".
    out = cli(
        "prepare",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus.txt",
        "--storage",
        str(tmp_path / "storage"),
        env=on_session_server(wrong),
    )
    line = one_line_error(out, f"the credentials for s3://{BUCKET}/corpus.txt were refused")
    assert "local copy" not in line and not (tmp_path / "storage").exists()

    # The user's own keys pass the same check, and the data stages run in the bucket.
    out = cli(
        "prepare",
        "--recipe",
        "smoke",
        "--source",
        f"s3://{BUCKET}/corpus.txt",
        "--storage",
        f"s3://{BUCKET}/ok",
        env={**good, **on_session_server(stores)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=server.direct_url,
        aws_access_key_id=good["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=good["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="ok/")["Contents"]]
    assert any(k.startswith("ok/raw/") for k in keys) and not any(".mllm-write-test" in k for k in keys)


@dataclass
class Held:
    """A connection to the silent endpoint: when it was accepted and when its client closed it."""

    opened: float
    closed: float | None = None


@pytest.fixture
def silent_endpoint():
    """A TCP port that accepts connections and never answers (a store that hangs), and each
    connection's times: how long a client waited before it gave up, whatever its start cost."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    sockets: list[socket.socket] = []
    connections: list[Held] = []

    def wait_for_close(sock: socket.socket, times: Held) -> None:
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass
        times.closed = time.monotonic()

    def accept() -> None:
        while True:
            try:
                sock = listener.accept()[0]
            except OSError:
                return
            sockets.append(sock)
            connections.append(Held(time.monotonic()))
            threading.Thread(target=wait_for_close, args=(sock, connections[-1]), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", connections
    listener.close()
    for sock in sockets:
        sock.close()


def test_a_storage_root_on_a_store_that_never_answers_fails_within_its_timeouts(silent_endpoint, stores, tmp_path):
    endpoint, connections = silent_endpoint
    env = {
        **stores,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "1",
        "MLLM_S3_READ_TIMEOUT": str(READ_S),
    }
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(tmp_path / "corpus.txt"),
        "--storage",
        f"s3://{BUCKET}/x",
        env=env,
        timeout=120,
    )
    one_line_error(out, "storage unreachable (ReadTimeoutError", endpoint)
    # One attempt (one connection), given up after the read timeout set, not botocore's 60 s nor
    # the project's 10 s. Timed at the endpoint: the command's start, 8-20 s here, varies with load.
    assert len(connections) == 1, connections
    waited = connections[0].closed - connections[0].opened
    assert READ_S <= waited < READ_S + 2, waited
    _nothing_started(tmp_path)


def test_a_store_that_hangs_mid_training_ends_the_run_like_a_dead_one_and_keeps_the_checkpoint(stores, tmp_path):
    with run_s3_server(tmp_path / "s3") as server:
        server.client().create_bucket(Bucket=BUCKET)
        # One attempt per request (AWS_MAX_ATTEMPTS=1) keeps the test short: the bound scales with it;
        # Prefect's two retries of the training come a second after each failure, not five.
        proc = prewarmed.start(
            "flows.cli",
            [
                "run",
                "--recipe",
                "smoke",
                "--source",
                str(tmp_path / "corpus.txt"),
                "--storage",
                f"s3://{BUCKET}/hang",
                *[a for s in LONG for a in ("--set", s)],
            ],
            _env(
                {
                    **server.env,
                    **on_session_server(stores),
                    "AWS_MAX_ATTEMPTS": "1",
                    "MLLM_S3_READ_TIMEOUT": str(READ_S),
                    "MLLM_TRAIN_RETRY_DELAY_S": "1",
                }
            ),
        )
        stopped = None
        try:
            deadline = time.monotonic() + 240
            while not _keys(server, "hang/runs/", "checkpoints/last.pt"):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.5)
            os.kill(server.process.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            _, err = proc.communicate(timeout=600)
            took = time.monotonic() - stopped
        finally:
            if stopped is not None:
                os.kill(server.process.pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
        print(f"hung store to exit: {took:.0f} s")
        assert proc.returncode == 2, err[-3000:]
        assert "Traceback" not in err and "Retry 2/2" in err  # Prefect retried the training, which hung again
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: storage unreachable") and server.url in last, last
        # About 5 requests of one attempt each, three trainings (Prefect's two retries) and their starts.
        assert took < 5 * READ_S + 150, took
        # The store is back: the last checkpoint written before the hang is whole.
        from mllm.runtime.checkpoint import read_checkpoint

        [key] = _keys(server, "hang/runs/", "checkpoints/last.pt")
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env.items():
                mp.setenv(k, v)
            assert read_checkpoint(f"s3://{BUCKET}/{key}")["step"] >= 50


def _keys(server, prefix: str, suffix: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for o in listing.get("Contents", []) if o["Key"].endswith(suffix)]


def test_the_clis_own_advice_works_on_a_run_in_s3(s3, stores, tmp_path):
    env = {**s3.env, **on_session_server(stores)}
    fast = ["train.max_steps=12", "train.eval_interval=6", "train.checkpoint_interval=6", "sample.max_new_tokens=20"]
    out = cli(
        "run",
        "--recipe",
        "smoke",
        "--source",
        str(tmp_path / "corpus.txt"),
        "--storage",
        f"s3://{BUCKET}/advice",
        *[a for s in fast for a in ("--set", s)],
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    checkpoint = next(line.split()[-1] for line in out.stdout.splitlines() if line.strip().startswith("checkpoint:"))
    run_id = next(line.split()[-1] for line in out.stdout.splitlines() if line.startswith("mlflow run:"))
    assert checkpoint.startswith(f"s3://{BUCKET}/advice/")
    greedy = ["--prompt", "The ", "--method", "greedy", "--max-new-tokens", "10"]

    # `auto`, which the error for a missing GPU recommends, works for a checkpoint and a registered model.
    out = cli("sample", "--checkpoint", checkpoint, "--device", "auto", *greedy, env=env)
    assert out.returncode == 0 and out.stdout.startswith("The "), out.stderr[-3000:]
    text = out.stdout
    out = cli("sample", "--model", "smoke@champion", "--device", "auto", *greedy, env=env)
    assert out.returncode == 0 and out.stdout == text, out.stderr[-3000:]
    import torch

    if not torch.cuda.is_available():  # --device with --model is honoured, so a missing GPU is refused
        one_line_error(
            cli("sample", "--model", "smoke@champion", "--device", "cuda", *greedy, env=env),
            "no CUDA GPU is visible here",
            "auto",
        )
    one_line_error(
        cli("sample", "--checkpoint", checkpoint, "--method", "beam", "--top-p", "0.5", env=env),
        "--top-p does not apply to --method beam",
        "--method top-p",
    )

    one_line_error(
        cli("lineage", "--corpus", "a" * 66, "--storage", f"s3://{BUCKET}/advice", env=env),
        "66 hex characters, a sha256 has 64",
    )
    # A recorded commit that the repository does not hold is a broken link, not "ok".
    from mlflow.tracking import MlflowClient

    MlflowClient(stores["MLFLOW_TRACKING_URI"]).set_tag(run_id, "git.commit", "f" * 40)
    out = cli("lineage", run_id, "--storage", f"s3://{BUCKET}/advice", env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "[MISSING]" in next(line for line in out.stdout.splitlines() if line.startswith("code"))
    assert "commit ffffffffffff is not in the repository" in out.stdout and "broken links: code" in out.stdout

    # The time zone of an interval schedule is checked as a cron's is, and named.
    one_line_error(
        cli("schedule", "--recipe", "smoke", "--interval", "60", "--timezone", "Mars/Olympus", env=env),
        "unknown --timezone 'Mars/Olympus'",
    )
