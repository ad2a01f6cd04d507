"""The read-only web side of gpuq: the dashboard's pages and the Prometheus metrics, both read from
the SQL the CLI reads (through ``gpuq.service``)."""
