"""MLflow: every use of the mlflow package lives here. A run's tracking (`runs`: the run,
its metrics, params, figures and samples; finding and comparing runs) and the Model Registry
with the promotion gate (`models`). The train flow's step log over it is `flows.tracking`."""
