"""``python -m gateway``: start the gateway (see gateway/app.py)."""

from gateway.app import main

raise SystemExit(main())
