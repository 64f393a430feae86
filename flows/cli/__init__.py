"""`hybridrl`, the command line (typer): `main` (train, resume, fork, replay, pool, deploy),
`runs` (list, show, compare, tree, delete), `models` (evaluate, register), `cluster`, the
shared options (`options`) and the checks that run before Prefect starts (`preflight`)."""

from flows.cli.main import app

__all__ = ["app"]
