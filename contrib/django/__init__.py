"""Django integration (see issue: placed first in MIDDLEWARE)."""
