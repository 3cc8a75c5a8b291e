"""The jobs that ship with paramserver: what ``ps-worker`` runs when ``ps-server --job`` names none.

The default is the CTR job, ``paramserver.jobs.ctr:main`` (``runtime.job.DEFAULT_JOB``): a
hybrid model on the Trainer, over planted data (``ctr_data``) or files (``ctr_files`` writes
planted ones).  Each job is ``main(ctx, **config) -> dict`` (see ``paramserver.runtime.job``).

This package sits at the top, beside the jobs of a cluster (``workers/`` in a checkout): it
imports paramserver's public API, and nothing in paramserver imports it (the default job is
named by string).
"""
