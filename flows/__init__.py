"""Flows and the `hybridrl` command line."""

import tasks  # noqa: F401  (sets Prefect's environment defaults before Prefect is imported)
