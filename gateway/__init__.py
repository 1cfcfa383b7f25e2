"""SplitSpec gateway: the client-facing service (``python -m gateway --help``)."""
