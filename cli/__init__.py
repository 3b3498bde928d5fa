"""The `fxport` command line: its own room, on top of every other one.

The client library (fxport.client) submits and follows jobs over gRPC; the CLI wraps it in
commands (`submit`, `jobs ...`), and also runs the engine locally (`convert`), the API server
(`serve`), the workers (`worker`), and the token, report and package commands. It is the one
room that may import any other (tests/test_import_boundaries.py holds the rooms to it), and it
imports the heavy ones (grpc server, Celery, the engine) only inside the commands that need
them, so `fxport submit` works from the base install.

    cli/commands.py        the typer app, `main` (the console script), submit / jobs / serve / worker
    cli/convert_command.py `fxport convert`: the engine on this machine, no server
    cli/errors.py          how the CLI words errors and which exit code a job gets
    cli/server.py          the API server with its embedded worker pool, as `fxport serve` runs it
"""

from fxport.cli.commands import app, main

__all__ = ["app", "main"]
