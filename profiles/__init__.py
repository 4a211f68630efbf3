"""Hardware profiles shipped as package data (``*.toml``); read them with ``runtime.config.profiles.load_profile``."""
