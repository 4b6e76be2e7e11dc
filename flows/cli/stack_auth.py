"""`mllm-pipeline stack user ...` and `stack worker-env`: the secured stack's users and what a
remote worker needs (flows/stack/auth.py). Registered on the `stack` command group."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from flows.cli.servers import StackHome, stack_app
from flows.cli.terminal import user_errors
from flows.stack import audit as stack_audit
from flows.stack import auth as stack_auth
from flows.stack import servers as stack
from mllm import UserError
from mllm.settings import environment

user_app = typer.Typer(
    no_args_is_help=True,
    help=(
        "The secured stack's users: each person and worker has a secret of its own, and a role: admin, worker "
        "(runs flows, logs runs, registers models, moves aliases) or viewer (reads only)."
    ),
)
stack_app.add_typer(user_app, name="user")

Role = Annotated[str, typer.Option("--role", metavar="ROLE", help="admin, worker or viewer.")]
UserName = Annotated[str, typer.Argument(metavar="NAME", help="The user's name.")]


def _apply(home) -> str:
    """Give the running stack the users file as it is now: the proxy at once, MLflow's users."""
    if stack_auth.secured(home) is None or not stack_auth.reload_proxy(home):
        return "the stack is not running secured: it takes the users at its next `stack up --auth`/`--listen`"
    stack_auth.sync_mlflow(home)
    return "the running stack took it at once"


Pools = Annotated[
    Optional[list[str]],
    typer.Option(
        "--pool",
        metavar="POOL",
        help="Bind a worker to this pool (repeat for more): it serves, claims and starts runs of these pools only.",
    ),
]


@user_app.command("add")
def user_add(name: UserName, role: Role = "worker", pool: Pools = None, home: StackHome = None) -> None:
    """Add a user with a new random secret; `stack worker-env --user NAME` prints its settings."""
    with user_errors():
        folder = stack.stack_home(home)
        stack_auth.add_user(folder, name, role, pools=pool)
        bound = f", pools {', '.join(sorted(set(pool)))} only" if pool else ""
        typer.echo(
            f"user {name} ({role}{bound}) added; {_apply(folder)}. Its settings: "
            f"`mllm-pipeline stack worker-env --user {name}`"
        )


@user_app.command("remove")
def user_remove(name: UserName, home: StackHome = None) -> None:
    """Remove a user: its secret stops working at once on a running stack."""
    with user_errors():
        folder = stack.stack_home(home)
        stack_auth.remove_user(folder, name)
        typer.echo(f"user {name} removed; {_apply(folder)}")


@user_app.command("rotate")
def user_rotate(name: UserName, home: StackHome = None) -> None:
    """Give a user a new random secret: the old one stops working at once on a running stack."""
    with user_errors():
        folder = stack.stack_home(home)
        stack_auth.rotate_user(folder, name)
        typer.echo(
            f"user {name} has a new secret; {_apply(folder)}. Hand it its new settings: "
            f"`mllm-pipeline stack worker-env --user {name}`"
        )


@user_app.command("list")
def user_list(home: StackHome = None) -> None:
    """The users and their roles (never their secrets)."""
    users = stack_auth.read_users(stack.stack_home(home))["users"]
    if not users:
        typer.echo(
            "no users: `mllm-pipeline stack up --auth` (or --listen ADDRESS) makes the stack's own, "
            "`stack user add NAME --role worker` adds one"
        )
    for name, u in sorted(users.items()):
        own = "  (the stack's own)" if name in stack_auth.BUILT_IN else ""
        bound = f"  (pools {', '.join(u['pools'])} only)" if u.get("pools") else ""
        typer.echo(f"{name:24} {u['role']}{own}{bound}")


@stack_app.command("worker-env")
def worker_env(
    home: StackHome = None,
    user: Annotated[str, typer.Option(metavar="NAME", help="Whose credential.")] = "stack-worker",
    ca_path: Annotated[
        Optional[str],
        typer.Option(metavar="PATH", help="Where the CA file will be on the worker [the stack home's copy]."),
    ] = None,
    with_storage_credentials: Annotated[
        bool, typer.Option("--with-storage-credentials", help="Add this shell's AWS_* credentials for the bucket.")
    ] = False,
) -> None:
    """Print what a remote worker needs in docker --env-file form (KEY=VALUE lines): the servers'
    URLs, the user's credential, the CA file, the pool and the storage. Holds a secret: write it
    to a file only its owner reads."""
    with user_errors():
        folder = stack.stack_home(home)
        state = stack.load(folder)
        if stack_auth.secured(folder) is None:
            raise UserError(
                f"the stack in {folder} is not secured: start it with `mllm-pipeline stack up --listen "
                "ADDRESS` (or --auth), whose workers then reach it with credentials of their own"
            )
        env = stack_auth.client_env(folder, user, ca_path)
        env["PREFECT_WORK_POOL"] = state.get("pool", "local")
        if state.get("storage"):
            env["MLLM_STORAGE"] = state["storage"]
        here = environment()
        for k in ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            if here.get(k):
                env[k] = here[k]
        if with_storage_credentials:
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
                if here.get(k):
                    env[k] = here[k]
        for k, v in env.items():
            if "\n" in v:
                raise UserError(f"{k} holds a line break, which docker's --env-file cannot carry")
            print(f"{k}={v}")  # print, not the console: the secret must not be scrubbed here


@stack_app.command("audit")
def audit(
    user: Annotated[Optional[str], typer.Option("--user", metavar="NAME", help="Only this user's entries.")] = None,
    since: Annotated[
        Optional[str], typer.Option("--since", metavar="WHEN", help="An ISO time, or an age: 30m, 2h, 1d.")
    ] = None,
    failed: Annotated[bool, typer.Option("--failed", help="Only refused credentials and lockouts.")] = False,
    home: StackHome = None,
) -> None:
    """The secured stack's audit: every write, websocket and refused credential, oldest first."""
    with user_errors():
        folder = stack.stack_home(home)
        when = stack_audit.since_time(since)
        if since and when is None:
            raise UserError(f"--since {since!r} is neither an ISO time nor an age such as 30m, 2h, 1d")
        if not stack_audit.audit_file(folder).exists():
            raise UserError(f"no audit in {folder}: it is written by a secured stack (`stack up --auth` or --listen)")
        for entry in stack_audit.entries(folder, user, when, failed):
            typer.echo(stack_audit.line(entry))
