"""FX passes of the tinyserve backend, one per file."""
