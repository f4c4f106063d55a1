"""Page-selection policies."""
