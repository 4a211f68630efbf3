"""Package data: draft-tree presets and the embedded demo bundle."""
