"""Hardware profiles shipped as package data (``*.toml``); read them with ``runtime.profiles.load_profile``."""
