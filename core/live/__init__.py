"""A run as it happens: the one run loop, the engine process that hosts it, the session model the window shows,
spikes, the breakdown of the total, the like-for-like comparison, and the Prometheus exporter."""
