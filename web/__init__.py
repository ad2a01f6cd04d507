"""The read-only web side of gpuq: the dashboard's pages and the Prometheus metrics, both read from
the server's API (``/v1/...``) that the CLI reads, in its public view; no database of their own."""
