"""`fxport tokens new|hash`: make API tokens and the hashed lines of the server's tokens file.

The server stores only `TENANT: SHA256-HEX` lines (FXPORT_TOKENS_FILE); the token itself is
shown once, on stdout, and kept by whoever calls the API (FXPORT_TOKEN / --token).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from fxport.errors import EXIT_OK, EXIT_USAGE

tokens_app = typer.Typer(no_args_is_help=True, help="Create API tokens and tokens-file entries (stored hashed).")
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _entry_or_exit(tenant: str, token: str) -> str:
    from fxport.service.auth import token_entry

    try:
        return token_entry(tenant, token)
    except ValueError as exc:
        _err.print(f"[red]fxport tokens: error:[/] {exc}")
        raise typer.Exit(EXIT_USAGE) from exc


def _append(path: Path, line: str) -> None:
    """Append one entry; a new file is created readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        if f.tell() > 0:
            with open(path, "rb") as r:  # keep one entry per line if the file lacks a final newline
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write("\n")
        f.write(line + "\n")


@tokens_app.command("new")
def tokens_new(
    tenant: str = typer.Argument(..., help="Tenant the token acts for (lowercase letters, digits, _ and -)."),
    tokens_file: Path | None = typer.Option(None, "--tokens-file", help="Append the hashed entry to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print {tenant, token, entry} as one JSON document."),
) -> None:
    """Generate a token for TENANT: the token on stdout (shown once), its hashed entry for the tokens file."""
    from fxport.service.auth import new_token

    token = new_token()
    entry = _entry_or_exit(tenant, token)
    if tokens_file is not None:
        _append(tokens_file, entry)
        _err.print(f"added an entry for tenant {tenant!r} to {tokens_file} (the server re-reads it on change)")
    else:
        _err.print(f"add this line to the server's tokens file (FXPORT_TOKENS_FILE):\n{entry}")
    if as_json:
        sys.stdout.write(json.dumps({"tenant": tenant, "token": token, "entry": entry}) + "\n")
    else:
        print(token)
    raise typer.Exit(EXIT_OK)


@tokens_app.command("hash")
def tokens_hash(
    tenant: str = typer.Argument(..., help="Tenant the token acts for."),
    token: str | None = typer.Option(None, "--token", help="The token (default: read from stdin, "
                                        "which keeps it out of shell history and `ps`)."),
) -> None:
    """Print the tokens-file entry `TENANT: SHA256` for an existing token."""
    if token is None:
        token = sys.stdin.readline().strip()
    if not token:
        _err.print("[red]fxport tokens: error:[/] no token given (pass --token or pipe it on stdin)")
        raise typer.Exit(EXIT_USAGE)
    print(_entry_or_exit(tenant, token))
    raise typer.Exit(EXIT_OK)
