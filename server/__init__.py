"""gpuq's server: the one process that acts for users (`gpuq server`).

It alone, with the scheduler and the workers, holds the database and broker credentials. Who asks
comes from the kernel (a Unix socket's peer uid) or from munged (a MUNGE credential over TCP);
rights are checked here (service/rights.py). The client (cli/) speaks its JSON API, ``/v1/...``.
"""
