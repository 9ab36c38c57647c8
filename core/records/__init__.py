"""What a run leaves behind and what other servers publish: recordings, CSV export, the files the user names,
and the scraper that reads inference servers' metrics."""
