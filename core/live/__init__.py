"""A run as it happens: the one run loop, the engine process that hosts it, the hardware probes, the
session model the window shows, spikes, the breakdown of the total and the like-for-like comparison."""
