"""Counter backends, chosen from a URL."""
