"""Configuration as data: every method and sampling option declared once (`method_options`), the
hardware profiles' schema (`profiles`), value checks (`validation`) and TOML reading
(`toml_compat`). Imports nothing above `runtime.utils`."""
