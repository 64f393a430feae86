"""Flows and the `hybridrl` command line."""
