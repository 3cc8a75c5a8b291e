"""A cluster's own jobs, run from a checkout: ``ps-server --job workers.X:main`` (see README.md here).

The jobs that ship with paramserver, the default CTR job among them, are ``paramserver.jobs``.
"""
