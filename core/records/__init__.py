"""What a run leaves behind and who reads it: the ``Sample``, recordings, CSV export, the files the
user names, the Prometheus exporter, and the scraper that reads other servers' metrics."""
