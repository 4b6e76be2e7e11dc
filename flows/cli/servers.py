"""`mllm-pipeline schedule` and `mllm-pipeline stack`: the commands that drive a Prefect server
(schedules on it) or start one on this machine (the local stack). Registered on the CLI's app."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.cli.app import ModelName, Sets, Source, Storage, TrainingStorage, app
from flows.cli.terminal import console, flows_module, user_errors
from flows.stack import database
from flows.stack import servers as stack
from mllm import UserError

schedule_app = typer.Typer(
    invoke_without_command=True,
    rich_markup_mode="markdown",
    help=(
        "Retrain a recipe on a schedule: create or update its deployment `pipeline/RECIPE` on the Prefect "
        "server ($PREFECT_API_URL), or pause, resume or delete it. `schedule list` shows them all."
    ),
)
app.add_typer(schedule_app, name="schedule")


@schedule_app.callback()
def schedule(
    ctx: typer.Context,
    recipe: Annotated[
        Optional[str], typer.Option("--recipe", "-r", metavar="NAME", help="The recipe to retrain.")
    ] = None,
    cron: Annotated[
        Optional[str], typer.Option(metavar="CRON", help='When, as a cron line: "0 3 * * 0" is Sundays at 03:00.')
    ] = None,
    interval: Annotated[Optional[float], typer.Option(metavar="SECONDS", help="Or every this many seconds.")] = None,
    timezone: Annotated[str, typer.Option(metavar="TZ", help="The schedule's time zone (an IANA name).")] = "UTC",
    pool: Annotated[str, typer.Option(metavar="POOL", help="The work pool whose worker runs the pipeline.")] = "local",
    train_on: Annotated[
        Optional[str],
        typer.Option(
            "--train-on",
            metavar="POOL",
            help="A work pool whose worker trains the model (default: the recipe's pipeline.pool, "
            "else the --pool worker that runs the scheduled pipeline).",
        ),
    ] = None,
    source: Source = None,
    storage: TrainingStorage = None,
    set_: Sets = None,
    pause: Annotated[bool, typer.Option("--pause", help="Pause the recipe's schedule.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Resume it.")] = False,
    delete: Annotated[bool, typer.Option("--delete", help="Delete the deployment and its schedule.")] = False,
    model: ModelName = None,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    with user_errors():
        if recipe is None:
            raise UserError("give --recipe NAME (and --cron or --interval), or use `mllm-pipeline schedule list`")
        from flows import schedule as sched

        if sum([pause, resume, delete]) > 1:
            raise UserError("give one of --pause, --resume or --delete")
        if pause or resume or delete:
            (sched.pause if pause else sched.resume if resume else sched.delete)(recipe)
            typer.echo(f"pipeline/{recipe}: {'paused' if pause else 'resumed' if resume else 'deleted'}")
            return
        from mllm.redact import strip_userinfo
        from mllm.resolve import Overrides, absolute_source

        given = {
            "--source": source or [],
            "--storage": [storage] if storage else [],
            "--set": [item.partition("=")[2].strip() for item in set_ or []],
        }
        carrying = [option for option, urls in given.items() if any(strip_userinfo(u)[1] for u in urls)]
        if carrying:
            # A scheduled run downloads in a worker, later: the password would have to be stored
            # in the deployment's parameters, in Prefect's database.
            raise UserError(
                f"a scheduled {carrying[0]} cannot carry a user:password: give the worker its credentials "
                "(AWS_* for s3://, a ~/.netrc for https://) and schedule the URL without them"
            )
        source = [absolute_source(s) for s in source or []]  # the worker runs in a folder of its own
        d = sched.upsert(
            recipe,
            cron=cron,
            interval=interval,
            timezone=timezone,
            pool=pool,
            train_on=train_on,
            source=(source[0] if len(source) == 1 else source) if source else None,
            storage_url=storage,
            overrides=Overrides.parse(set_),
            model=model,
        )
        typer.echo(
            f"{d['name']}: {d['schedule']} on pool {d['pool']!r}; next run {d['next_run'] or 'not yet scheduled'}"
        )
        typer.echo(f"parameters: {d['parameters']}")


@schedule_app.command("list")
def schedule_list(json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The scheduled recipes: schedule, paused or not, next and last run."""
    with user_errors():
        from flows import schedule as sched

        rows = sched.list_schedules()
        if json_:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            typer.echo('no schedules: create one with `mllm-pipeline schedule --recipe NAME --cron "0 3 * * 0"`')
        for r in rows:
            typer.echo(
                f"{r['name']:28} {r['schedule']:28} {'PAUSED' if r['paused'] else 'active':7} pool {r['pool']:10} "
                f"next {r['next_run'] or '-'}  last {r['last_run'] or '-'}"
            )


stack_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="markdown",
    help="A local Prefect server, process worker and MLflow server on 127.0.0.1.",
)
app.add_typer(stack_app, name="stack")
StackHome = Annotated[
    Optional[str],
    typer.Option(
        "--home",
        metavar="DIR",
        help="Where the stack keeps its state, databases and logs (default: $MLLM_STACK_HOME or ./.mllm-stack).",
    ),
]


Pool = Annotated[str, typer.Option(metavar="POOL", help="The process work pool its worker serves.")]
AnyPort = Annotated[int, typer.Option(metavar="PORT", help="0: any free port.")]
DatabaseUrl = Annotated[
    Optional[str],
    typer.Option(
        metavar="postgresql://USER:PASSWORD@HOST:PORT/NAME",
        help="Keep Prefect's and MLflow's records on this PostgreSQL server (databases NAME_prefect, "
        "NAME_mlflow) [a PostgreSQL cluster of the stack's own when the machine has the server, "
        "else SQLite]. The password stays in the servers' environment only.",
    ),
]
Slots = Annotated[
    Optional[int],
    typer.Option(
        metavar="N",
        help="Trainings the pool runs at once; the rest wait their turn [1 per GPU, else 1 per 2 cores].",
    ),
]
Listen = Annotated[
    str,
    typer.Option(
        metavar="ADDRESS",
        help="Serve Prefect and MLflow on this address. Any but loopback: always HTTPS "
        "with each user's credential checked (docs/team-stack.md).",
    ),
]
Auth = Annotated[bool, typer.Option("--auth", help="HTTPS and users on a loopback stack too.")]
TlsCert = Annotated[
    Optional[str],
    typer.Option(
        metavar="FILE",
        help="The team's certificate (PEM, chain included) [a CA and certificate of the stack's own].",
    ),
]
TlsKey = Annotated[Optional[str], typer.Option(metavar="FILE", help="Its private key (PEM).")]
LocalWorker = Annotated[
    bool,
    typer.Option(
        "--local-worker",
        help="A secured stack runs a worker of its pool on this machine too (its flow "
        "runs then run as the stack's user, beside its keys); a loopback stack always does.",
    ),
]


@stack_app.command(
    "up",
    help=(
        "Start the stack, or what of it is down: services that run are reused, a dead one is started again on its "
        "port (the database's server first). MLflow's artifacts go to the storage root. Prints the stack's URLs."
    ),
)
def stack_up(
    home: StackHome = None,
    storage: Storage = None,
    pool: Pool = "local",
    prefect_port: AnyPort = 4200,
    mlflow_port: AnyPort = 5000,
    database_url: DatabaseUrl = None,
    slots: Slots = None,
    listen: Listen = "127.0.0.1",
    auth: Auth = False,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    local_worker: LocalWorker = False,
) -> None:
    with user_errors():
        if slots is not None and slots < 1:
            raise UserError(f"--slots {slots}: give at least 1 (the trainings the pool runs at once)")
        root = flows_module().storage_root(storage)
        folder = stack.stack_home(home)
        if slots is None and not any(ok for _, ok in stack.status(folder)):
            slots = stack.default_slots()  # a new stack; a running one keeps the limit it has
        console.print(f"starting the stack in {folder} (logs in {folder / 'logs'}) ...", highlight=False)
        try:
            state = stack.up(
                folder,
                root,
                pool,
                prefect_port,
                mlflow_port,
                database_url=database_url,
                slots=slots,
                listen=listen,
                auth=auth,
                tls_cert=tls_cert,
                tls_key=tls_key,
                local_worker=local_worker or None,
            )
        except RuntimeError as e:
            raise UserError(f"the stack did not start: {e}") from None
        _report_up(state, folder)


def _report_up(state: dict, folder) -> None:
    """What `stack up` found and did, beyond the endpoints: no local worker, what it reused or
    started again, the flow runs it marked Crashed or cancelled, a note on its database."""
    if not any(s.name == "worker" for s in state["services"]):
        console.print(
            f"no worker on this machine: pool {state['pool']!r} is served by the team's workers "
            "(`mllm-pipeline stack worker-env --user NAME`); `stack up --local-worker` runs one here",
            highlight=False,
            soft_wrap=True,
        )
    if state["reused"]:
        again = f"started again: {', '.join(state['restarted'])}; " if state["restarted"] else "nothing to start; "
        console.print(f"{again}running already, reused: {', '.join(state['reused'])}", highlight=False, soft_wrap=True)
    if state.get("crashed"):
        names = _some(state["crashed"])
        console.print(
            f"marked Crashed, freeing their slots of pool {state['pool']!r}: {len(state['crashed'])} flow "
            f"run(s) whose process is gone ({names}); run their commands again to resume them",
            highlight=False,
            soft_wrap=True,
        )
    if state.get("closed"):
        names = _some(state["closed"])
        console.print(
            f"marked Crashed: {len(state['closed'])} flow run(s) left in flight by commands that ended as "
            f"the database was down ({names}); run their commands again to resume them",
            highlight=False,
            soft_wrap=True,
        )
    if state.get("cancelled"):
        names = _some(state["cancelled"])
        console.print(
            f"cancelled: {len(state['cancelled'])} training(s) those commands had queued on pool "
            f"{state['pool']!r} ({names}); no worker had taken them",
            highlight=False,
            soft_wrap=True,
        )
    note = database.recorded(folder).get("note")
    if note:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    _print_stack(state, folder)


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


@stack_app.command("down")
def stack_down(
    home: StackHome = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Stop it even under flow runs in flight (they crash; a re-run resumes them)."),
    ] = False,
) -> None:
    """Stop what `stack up` started, and only that. Refused while flow runs on its Prefect server
    are pending, running or cancelling (it names them), unless --force."""
    with user_errors():
        stopped = stack.down(stack.stack_home(home), force=force)
        if not stopped:
            typer.echo("no stack was running")
        for name, was_running in stopped:
            typer.echo(f"{name:15} {'stopped' if was_running else 'was not running'}")


@stack_app.command("status")
def stack_status(home: StackHome = None) -> None:
    """Say what of the stack runs; exit status 1 unless all of it does."""
    folder = stack.stack_home(home)
    services = stack.status(folder)
    if not services:
        typer.echo(f"no stack in {folder}: start one with `mllm-pipeline stack up`")
        raise typer.Exit(1)
    for s, ok in services:
        typer.echo(f"{s.name:15} {'running' if ok else 'NOT RUNNING':12} {s.url or ''}  (pid {s.pid}, log {s.log})")
    if not all(ok for _, ok in services):
        down = [f"{s.name} (the servers' database)" if s.name == "postgres" else s.name for s, ok in services if not ok]
        typer.echo(f"down: {', '.join(down)}; start it again with `mllm-pipeline stack up` (what runs is reused)")
        raise typer.Exit(1)
    _print_stack(stack.load(folder), folder, services=False)


def _print_stack(state: dict, home: Path, services: bool = True) -> None:
    if services:
        for s in state["services"]:
            typer.echo(f"{s.name:15} {s.url or ''}")
    if database.recorded(home):
        typer.echo(f"{'database':15} {database.recorded(home)['database']}")
    if state.get("env"):
        limit = stack.slots_of(state["env"]["PREFECT_API_URL"], state.get("pool", "local"))
        typer.echo(
            f"{'slots':15} {limit if limit is not None else 'no limit'} (trainings pool "
            f"{state.get('pool', 'local')!r} runs at once)"
        )
    typer.echo("Use it from a shell with:")
    typer.echo("  export " + " ".join(f"{k}={v}" for k, v in state["env"].items()))
    if state["env"].get("PREFECT_API_SSL_CERT_FILE"):  # a secured stack (docs/team-stack.md)
        typer.echo(
            "and a user's credential: `mllm-pipeline stack user add NAME --role worker`, then "
            "`mllm-pipeline stack worker-env --user NAME` (docker --env-file lines)"
        )
    typer.echo(f"then: mllm-pipeline run --train-on {state.get('pool', 'local')}")
