"""Jobs that ``ps-worker`` runs.  Each is ``main(ctx, **config) -> dict`` (see
``paramserver.runtime.job.JobContext``); ``ps-server --job`` picks one and ships
its code to the workers by value."""
