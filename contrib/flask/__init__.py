"""Flask integration."""
