"""A run as it happens: the one run loop, the engine process that hosts it, ``run``'s live table in the terminal,
the session model the window shows, spikes, the breakdown of the total, the like-for-like comparison, and the
Prometheus exporter."""
