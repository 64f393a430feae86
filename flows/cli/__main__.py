"""`python -m flows.cli ...`: the same as `hybridrl ...`."""

from flows.cli.main import app

app()
