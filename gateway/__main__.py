"""``python -m gateway``: start the gateway (see gateway/app.py)."""

from gateway.app import main
from splitspec.signals import leave

leave(main())
