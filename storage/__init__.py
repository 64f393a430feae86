"""Where a run's results live: the final policy and its summary (stage state arrives with the
Prefect pipeline)."""
